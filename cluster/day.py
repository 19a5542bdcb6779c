"""A day compressed onto a real cluster: the online replicas a day asks for, the shipped lending controller,
offline work on Tidal's scheduler.

``tidal cluster simulate`` predicts a day from a model of each component. This module runs the same day on
real ones and records what happened, minute by minute, for the two to be set side by side (``bench``):

* an online Deployment (the Kubernetes deployment and replicaset controllers, the scheduler the cluster
  runs) scaled by Kubernetes' HorizontalPodAutoscaler on its pods' cpu, which ``cluster.daymetrics`` serves
  through the resource metrics API from the simulator's demand curve (its own series, so that the two runs
  differ only where the components do; the simulator models the HPA's rule, tolerance and stabilisation);
  or, without the HPA, scaled each minute to the replicas the simulator's rule asks for;
* the lending controller (``cluster.lending``, as shipped: cordon, the Eviction API, the node-state
  label) every ``lending_period`` day minutes, on a ``DayClock``, the day compressed into
  ``seconds_per_minute`` of wall time each minute; its online windows read the day's clock;
* offline work: the simulator's offline jobs as ``reclaimed_cores`` pods placed by ``tidal cluster
  scheduler`` on the reclaimed capacity the nodes publish, lent nodes included; on KWOK nodes no agent
  runs, so ``cluster.daynodes`` stands in for each node's agent with the agents' own rules (the lending
  state machine and its notices, THE headroom rule, eviction by tier).

Recorded per day minute: the nodes labelled Offline, the replicas asked for and those running on online
nodes, the cores offline work ran on and the cluster's cpu busy; over the day, offline jobs completed,
evicted (by tier and cause) and killed outside a notice. Left out here, and said so: online latency (KWOK
pods serve nothing), and real agents (a stand-in on KWOK nodes).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from contracts.errors import TidalError
from contracts.states import OFFLINE
from kube import timeouts

ONLINE_APP = "tidal-day-online"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class DayError(TidalError):
    pass


class DayClock:
    """A day compressed: day minute ``m`` starts ``m * seconds_per_minute`` wall seconds after the clock's
    start. ``epoch(m)`` is that minute's time of day as an epoch (today's local midnight + ``m`` minutes),
    what the lending controller's online windows are read against."""

    def __init__(self, seconds_per_minute: float, monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, midnight: Optional[float] = None) -> None:
        if not seconds_per_minute > 0:
            raise DayError(f"seconds per day minute {seconds_per_minute!r}: must be > 0")
        self.seconds_per_minute = float(seconds_per_minute)
        self.monotonic, self.sleep = monotonic, sleep
        self.start = monotonic()
        if midnight is None:
            now = time.localtime()
            midnight = time.mktime((now.tm_year, now.tm_mon, now.tm_mday, 0, 0, 0, 0, 0, -1))
        self.midnight = midnight

    def reset(self) -> None:
        """Day minute 0 (or the first minute a run was given) starts now."""
        self.start = self.monotonic()

    def minute(self) -> float:
        return (self.monotonic() - self.start) / self.seconds_per_minute

    def epoch(self, minute: float) -> float:
        return self.midnight + minute * 60.0

    def wait_until(self, minute: float) -> float:
        """Sleeps until ``minute`` starts; returns how many day minutes late the call came (0 if early)."""
        left = minute * self.seconds_per_minute - (self.monotonic() - self.start)
        if left > 0:
            self.sleep(left)
            return 0.0
        return -left / self.seconds_per_minute


@dataclass
class DayRecord:
    replicas: List[int] = field(default_factory=list)  # asked for (the HPA's, or the script's), per day minute
    running: List[int] = field(default_factory=list)  # running on online nodes at the minute's sample
    unschedulable: List[int] = field(default_factory=list)  # pods the scheduler found no node for
    offline_labelled: List[int] = field(default_factory=list)  # nodes labelled Offline
    offline_busy: List[float] = field(default_factory=list)  # cores offline pods ran on (with offline work)
    util: List[float] = field(default_factory=list)  # the cluster's cpu busy, a share (with offline work)
    actions: List[str] = field(default_factory=list)  # "minute: action"
    evictions: List[str] = field(default_factory=list)  # "minute: node evicts ..." (with offline work)
    late_minutes: float = 0.0  # the most the driver fell behind the day's clock
    late_at: int = 0  # the day minute it was that late
    wall_s: float = 0.0
    offline: Dict[str, Any] = field(default_factory=dict)  # OfflineJobs.summary() over the day

    def day(self, skip: int) -> "DayRecord":
        """The record without its first ``skip`` minutes (a warmup), its actions still all listed."""
        return DayRecord(self.replicas[skip:], self.running[skip:], self.unschedulable[skip:],
                         self.offline_labelled[skip:], self.offline_busy[skip:], self.util[skip:], self.actions,
                         self.evictions, self.late_minutes, self.late_at, self.wall_s, self.offline)

    def summary(self, cores_per_node: float) -> Dict[str, Any]:
        short = [max(0, want - got) for want, got in zip(self.replicas, self.running)]
        out = {"minutes": len(self.replicas), "lent_node_hours": round(sum(self.offline_labelled) / 60.0, 2),
               "lent_core_hours": round(sum(self.offline_labelled) * cores_per_node / 60.0, 1),
               "short_replica_minutes": sum(short), "minutes_short": sum(1 for s in short if s),
               "most_short": max(short, default=0),
               "unschedulable_replica_minutes": sum(self.unschedulable), "lending_actions": len(self.actions),
               "late_minutes": round(self.late_minutes, 2), "late_at_minute": self.late_at,
               "wall_s": round(self.wall_s, 1)}
        # each take-back in the day: minutes from the decision until every replica asked for runs again
        back = []
        for action in self.actions:
            minute = int(action.split(":", 1)[0])
            if ": take back " not in action or not 0 <= minute < len(short):
                continue
            back.append(next((m - minute for m in range(minute, len(short)) if not short[m]), len(short) - minute))
        out["take_back_to_replicas_running_minutes"] = back
        if self.util:
            out["avg_util"] = round(sum(self.util) / len(self.util), 4)
            out["offline"] = dict(self.offline, core_hours=round(sum(self.offline_busy) / 60.0, 1))
            out["hourly_util"] = [round(sum(self.util[h:h + 60]) / len(self.util[h:h + 60]), 4)
                                  for h in range(0, len(self.util), 60)]
        return out


def deployment(namespace: str, replicas: int, replica_cores: float, image: str, labels: Dict[str, str],
               node_selector: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    pod_spec: Dict[str, Any] = {
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "web", "image": image,
                        "resources": {"requests": {"cpu": f"{int(replica_cores * 1000)}m", "memory": "64Mi"}}}]}
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": ONLINE_APP, "namespace": namespace, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": ONLINE_APP}},
                     "template": {"metadata": {"labels": {"app": ONLINE_APP, **labels}}, "spec": pod_spec}}}


def run_day(api_client, namespace: str, replicas: Sequence[int], replica_cores: float, clock: DayClock,
            lending, lending_period: int = 30, image: str = "registry.k8s.io/pause:3.10",
            node_selector: Optional[Dict[str, str]] = None, progress: Callable[[str], None] = lambda _: None,
            first_minute: int = 0, nodes=None, jobs=None, demand: Optional[Sequence[float]] = None,
            autoscaler: Optional[Dict[str, Any]] = None, metrics=None,
            metrics_gap: Optional[Tuple[int, int]] = None) -> DayRecord:
    """The day (``replicas``: one figure per minute, the first being day minute ``first_minute``: negative
    for minutes before the day's midnight) on the cluster ``api_client`` reaches; ``lending``: a
    ``cluster.lending.LendingController`` (its ``step`` is called with the day clock's time).

    With ``autoscaler`` (a HorizontalPodAutoscaler, ``cluster.daymetrics.hpa``) and ``metrics`` (a
    ``cluster.daymetrics.DayMetrics`` registered with the API server) the HPA scales the Deployment on the
    use ``metrics`` shows, told each minute which pods serve ``demand``: ``replicas`` gives the first
    minute's only, and the record holds what the HPA asked for; in ``metrics_gap`` (minutes of the day,
    start and end) the measurement is missing and ``metrics`` falls back as it does. Without, the Deployment
    is scaled to ``replicas`` minute by minute.

    With offline work: ``nodes`` (a ``cluster.daynodes.NodeStandIn`` over every node of the day), ``jobs``
    (``cluster.daynodes.OfflineJobs``, arrival minutes counted like ``replicas``) and ``demand`` (online's
    cores per minute, like ``replicas``)."""
    from kubernetes import client

    from cluster.daynodes import OFFLINE_APP, node_labels
    from kube.rest import Rest

    if lending_period < 1:
        raise DayError(f"lending period {lending_period}: at least one day minute")
    if not replicas:
        raise DayError("a day of no minutes")
    if (nodes is None) != (jobs is None) or (jobs is not None and (demand is None or len(demand) < len(replicas))):
        raise DayError("offline work needs the nodes' stand-in, the jobs and a demand figure for every minute")
    if (autoscaler is None) != (metrics is None) or (metrics is not None and (demand is None
                                                                             or len(demand) < len(replicas))):
        raise DayError("the autoscaler needs its metrics and a demand figure for every minute")
    apps = client.AppsV1Api(api_client)
    rest = Rest.from_config(api_client.configuration)  # the minute's reads as JSON: the client's objects are slow
    # an HPA does not scale a Deployment of no replicas (scaling is off at zero): it starts with its minimum
    first = max(1, int(replicas[0])) if autoscaler is not None else int(replicas[0])
    apps.create_namespaced_deployment(namespace, deployment(namespace, first, replica_cores, image,
                                                            {"tidal.io/day": "online"}, node_selector),
                                      _request_timeout=timeouts.CALL)
    # the day starts from the first minute's replicas all running, as a cluster in service would: a lending
    # pass over a Deployment still being created saw a fraction of its pods and lent a node at once
    deadline = time.monotonic() + 120
    while True:
        got = apps.read_namespaced_deployment(ONLINE_APP, namespace, _request_timeout=timeouts.CALL)
        if (got.status.ready_replicas or 0) >= first or time.monotonic() > deadline:
            if (got.status.ready_replicas or 0) < first:
                raise DayError(f"the online Deployment had {got.status.ready_replicas or 0} of {first} "
                               f"replicas ready after 120 s")
            break
        time.sleep(0.2)
    if autoscaler is not None:
        # the first minute's use shown before the HPA's first look, which would otherwise find no metric
        metrics.update(_serving(rest, namespace), float(demand[0]))
        rest.json("POST", f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers", autoscaler)
    clock.reset()
    record, current, started = DayRecord(), first, time.monotonic()
    for minute, want in enumerate(int(r) for r in replicas):
        late = clock.wait_until(minute)
        day_minute = first_minute + minute
        if late > record.late_minutes:
            record.late_minutes, record.late_at = late, day_minute
        if jobs is not None:
            if day_minute == 0:
                jobs.reset()  # counted from the day's first minute, as the simulator counts
            jobs.arrive(minute)  # first in the minute: bound by the time the pods are read below
        if autoscaler is not None:
            want = int((rest.json("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{ONLINE_APP}")
                        .get("spec") or {}).get("replicas") or 0)
        elif want != current:
            apps.patch_namespaced_deployment_scale(ONLINE_APP, namespace, {"spec": {"replicas": want}},
                                                   _request_timeout=timeouts.CALL)
            current = want
        if day_minute % lending_period == 0:
            for action in lending.step(now=clock.epoch(day_minute)):
                record.actions.append(f"{day_minute}: {action}")
        listed = rest.json("GET", "/api/v1/nodes").get("items") or []
        labels = node_labels(listed)
        offline = {n for n, state in labels.items() if state == OFFLINE}
        pods = rest.json("GET", f"/api/v1/namespaces/{namespace}/pods").get("items") or []
        ours = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get("app") == ONLINE_APP]
        serving = [p for p in ours if (p.get("status") or {}).get("phase") == "Running" and p["spec"].get("nodeName")
                   and not p["metadata"].get("deletionTimestamp")]
        running = sum(1 for p in serving if p["spec"]["nodeName"] not in offline)
        if metrics is not None:
            # the minute's demand over the pods a Service would send it to (running, not on a lent node)
            missing = metrics_gap is not None and in_day_window(metrics_gap, day_minute)
            metrics.update([p["metadata"]["name"] for p in serving if p["spec"]["nodeName"] not in offline],
                           None if missing else float(demand[minute]), day_minute)
        unschedulable = sum(1 for p in ours if not p["spec"].get("nodeName") and any(
            c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in (p.get("status") or {}).get("conditions") or []))
        record.replicas.append(want)
        record.running.append(running)
        record.unschedulable.append(unschedulable)
        record.offline_labelled.append(len(offline))
        if jobs is not None:
            requests: Dict[str, float] = {}
            for p in serving:
                requests[p["spec"]["nodeName"]] = requests.get(p["spec"]["nodeName"], 0.0) + replica_cores
            asked = sum(requests.values())
            use_ratio = min(1.0, float(demand[minute]) / asked) if asked else 0.0
            ended = nodes.follow(day_minute, labels)
            capacity = nodes.capacity(requests, use_ratio)
            jobs.observe(minute, (p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get("app")
                                  == OFFLINE_APP), {n: nodes.state(n) for n in nodes.nodes})
            record.evictions += jobs.evict(minute, capacity, ended)
            busy = jobs.run_minute(minute)
            nodes.publish(capacity)
            record.offline_busy.append(sum(busy.values()))
            record.util.append(sum(min(nodes.cores, requests.get(n, 0.0) * use_ratio + busy.get(n, 0.0))
                                   for n in nodes.nodes) / (nodes.cores * len(nodes.nodes)))
        if day_minute % 60 == 0:
            progress(f"{'warmup ' if day_minute < 0 else ''}{(day_minute // 60) % 24:02d}:00 replicas {want} "
                     f"(running {running}), {len(offline)} node(s) lent"
                     + (f", offline on {record.offline_busy[-1]:.0f} cores, {len(jobs.pods)} job pod(s)"
                        if jobs is not None else ""))
    record.wall_s = time.monotonic() - started
    if jobs is not None:
        record.offline = jobs.summary()
    return record


def in_day_window(window: Tuple[int, int], day_minute: int) -> bool:
    """Whether ``day_minute`` (any day's) falls in ``window``, minutes of the day (may wrap midnight)."""
    start, end, minute = window[0], window[1], day_minute % (24 * 60)
    return (start <= minute < end) if start <= end else (minute >= start or minute < end)


def _serving(rest, namespace: str) -> List[str]:
    """The online pods running (before the day: no node is lent yet)."""
    pods = rest.json("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector=app%3D{ONLINE_APP}").get("items") or []
    return [p["metadata"]["name"] for p in pods if (p.get("status") or {}).get("phase") == "Running"
            and p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]


def compare_replicas(real: Sequence[int], predicted: Sequence[int], tolerance: float = 0.0, lag: int = 0) \
        -> Dict[str, Any]:
    """Replicas asked for, minute by minute: the HPA's against the simulator's model of it. Two HPAs with
    one rule may each hold anywhere inside its ``tolerance`` (they do not move while the use is within it of
    the target), so where they began apart they stay apart until the use leaves the band; and the real one
    may act up to ``lag`` minutes after the model does (``HPA_LAG_MINUTES``). ``outside_tolerance`` counts the
    minutes further apart than that band of the prediction of the minute or of any of the ``lag`` before it
    (``lagging``: the minutes apart that only the lag explains); ``apart_at`` gives the first minutes apart
    as [minute, real, predicted]."""
    if len(real) != len(predicted):
        raise DayError(f"{len(real)} real minutes against {len(predicted)} predicted")

    def near(m: int, k: int) -> bool:
        return abs(real[m] - predicted[m - k]) <= math.ceil(tolerance * predicted[m - k])

    apart = [m for m, (a, b) in enumerate(zip(real, predicted)) if a != b]
    inside = [m for m in apart if near(m, 0)]
    lagging = [m for m in apart if not near(m, 0) and any(near(m, k) for k in range(1, min(lag, m) + 1))]
    outside = [m for m in apart if m not in inside and m not in lagging]
    return {"real_replica_minutes": int(sum(real)), "predicted_replica_minutes": int(sum(predicted)),
            "minutes_apart": len(apart), "lag_minutes": lag, "lagging": len(lagging),
            "outside_tolerance": len(outside), "first_outside_tolerance": outside[:10],
            "apart_at": [[m, int(real[m]), int(predicted[m])] for m in apart[:10]],
            "most_apart": max((abs(a - b) for a, b in zip(real, predicted)), default=0)}


def compare(real: Sequence[int], predicted: Sequence[int]) -> Dict[str, Any]:
    """Nodes labelled Offline, minute by minute, the real run against the simulator's."""
    if len(real) != len(predicted):
        raise DayError(f"{len(real)} real minutes against {len(predicted)} predicted")
    differ = [m for m, (a, b) in enumerate(zip(real, predicted)) if a != b]
    return {"real_node_minutes": int(sum(real)), "predicted_node_minutes": int(sum(predicted)),
            "minutes_that_differ": len(differ), "first_differ": differ[:10],
            "most_apart": max((abs(a - b) for a, b in zip(real, predicted)), default=0)}


def start_scheduler(plane, *flags: str, timeout: float = 60.0) -> subprocess.Popen:
    """``tidal cluster scheduler`` on ``plane`` (its log in the plane's directory), once it schedules."""
    log = os.path.join(plane.dir, "tidal-scheduler.log")
    proc = plane._spawn("tidal-scheduler", ["env", f"PYTHONPATH={REPO}", sys.executable, "-m", "agent.cli", "cluster",
                                            "scheduler", f"--kubeconfig={plane.kubeconfig()}", "--no-leader-elect",
                                            "--metrics-port=0", *flags])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, errors="replace") as handle:
            if "tidal scheduler: " in handle.read():
                return proc
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    with open(log, errors="replace") as handle:
        tail = handle.read()[-2000:]
    raise DayError(f"tidal cluster scheduler did not start in {timeout:g} s: {tail}")


DEFAULT_SECONDS_PER_MINUTE = 0.2  # the HPA's 5-minute scale-down window is then 1 s, a whole second
HPA_TARGET = 0.6
# how many day minutes after the simulator's model the real HPA may ask for a minute's replicas: the day
# shows a minute's use after it reads that minute's replicas (one), and the HPA, looking once a day minute
# (``controllers``), acts on it within one more. (In a real day it looks every 15 s: a quarter of a minute.)
HPA_LAG_MINUTES = 2


def controllers(seconds_per_minute: float = DEFAULT_SECONDS_PER_MINUTE) -> Dict[str, Any]:
    """What a day needs of kube-controller-manager (``ControlPlane.start_controller_manager``'s arguments):
    the deployment, replicaset and HPA controllers, the HPA looking once a day minute (its 15 s default would
    be 75 day minutes at 0.2 s a minute)."""
    return {"extra": ("deployment-controller", "replicaset-controller", "horizontal-pod-autoscaler-controller"),
            "flags": (f"--horizontal-pod-autoscaler-sync-period={max(1, round(seconds_per_minute * 1000))}ms",)}


def hpa_window(seconds_per_minute: float, minutes: int) -> int:
    """The HPA's scale-down stabilisation for ``minutes`` of a compressed day, in the whole seconds its field
    takes (at least 1)."""
    return max(1, int(round(minutes * seconds_per_minute)))


def bench(plane, fleet, shape: Dict[str, Any], nodes: int = 6, seconds_per_minute: float = DEFAULT_SECONDS_PER_MINUTE,
          lending_period: int = 30, hours: float = 24.0, online_peak_share: float = 0.5, replica_cores: int = 2,
          threshold: float = 0.9, notice: int = 5, offline: bool = True, autoscaler: bool = True,
          metrics_gap: Optional[str] = None, fallback: bool = True, trace=None, namespace: str = "tidal-day",
          progress: Callable[[str], None] = lambda _: None) -> Dict[str, Any]:
    """The simulator's day for ``nodes`` machines of ``shape``, then the same day on ``plane`` (its controllers
    as ``controllers()`` says and a scheduler running) over KWOK nodes of that shape (``fleet``, KWOK
    started): the report of both and where they part. With ``autoscaler``, a HorizontalPodAutoscaler scales
    online on the use ``cluster.daymetrics`` serves (started here); without, the simulator's replicas are
    set minute by minute; ``metrics_gap`` ("HH:MM-HH:MM") takes the metrics' measurement away for those
    minutes of each day, yesterday's same minute standing in (``fallback``; the simulator's curve repeats
    daily, so yesterday is remembered as today's curve) or nothing. ``trace``: a ``cluster.simulate.Trace``
    (``read_trace``) in place of the synthetic day: its online demand (cores, the whole cluster's) and its
    offline jobs, a job pinned to ``node-K`` placed on the day's K-th node; no warmup, as the simulator
    replays a trace. With ``offline``, the simulator's offline jobs run through the day as pods placed by
    Tidal's scheduler (started here) on what ``cluster.daynodes``' stand-in for the nodes' agents offers."""
    from cluster.daymetrics import DayMetrics, hpa
    from cluster.daynodes import NodeStandIn, OfflineJobs
    from cluster.lending import LendingController
    from cluster.scheduler.queue import BACKOFF_FIRST, BACKOFF_MAX
    from cluster.simulate import SimConfig, day_jobs, run as simulate_run
    from kube.rest import Rest

    from cluster.lending import parse_window

    gap = parse_window(metrics_gap) if metrics_gap else None
    cores = int(shape["allocatable"]["cpu"])
    # the HPA's scale-down window in whole seconds, and the simulator's model of it in the day minutes that is
    down_s = hpa_window(seconds_per_minute, SimConfig.hpa_down_minutes)
    # noise 0: the replicas are the demand curve's own
    config = SimConfig(nodes=nodes, cores=cores, hours=hours, noise=0.0, online_peak_share=online_peak_share,
                       replica_cores=replica_cores, hpa_target=HPA_TARGET,
                       hpa_down_minutes=max(1, int(round(down_s / seconds_per_minute))) if autoscaler
                       else SimConfig.hpa_down_minutes, lending_threshold=threshold,
                       lending_period_s=lending_period * 60.0, notice_minutes=notice if offline else 0)
    predicted = simulate_run(config, "tidal", trace)
    separate = simulate_run(config, "separate", trace)
    # both runs start at the simulator's warmup (its nodes unlent, its queues empty) and are compared over the day
    warmup = predicted["warmup_minutes"]
    replicas = [int(r) for r in predicted["replicas_by_minute"]]
    offline_predicted = [int(n) for n in predicted["offline_labelled_by_minute"]][warmup:]
    fleet.namespace(namespace)
    # no NodeResourceTopology reports: the nodes' state is the stand-in's annotation, as an agent without a
    # report writes it (Tidal's scheduler reads the report's where there is one)
    names = fleet.add_nodes(nodes, [shape], prefix=f"{namespace}-", reports=False)
    fleet.wait_ready(names, timeout=120)
    progress(f"{nodes} nodes of {shape['name']} ({cores} cpus each) Ready; the day (and {warmup} minutes before "
             f"it) in {len(replicas) * seconds_per_minute:.0f} s")
    lending = LendingController(plane.api_client(), threshold=threshold, echo=lambda _: None)
    rest = Rest.from_config(plane.api_client().configuration)
    scheduler = stand_in = jobs = metrics = scaler = None
    if autoscaler:
        metrics = DayMetrics(namespace, {"app": ONLINE_APP, "tidal.io/day": "online"}, fallback=fallback)
        for minute, cores_used in enumerate(predicted["demand_by_minute"]):
            metrics.remember(minute - warmup - 24 * 60, float(cores_used))
        certs = plane.extender_certs()  # a serving certificate for 127.0.0.1 (the APIService skips verifying it)
        metrics.register(rest, metrics.start(certs["tls_crt"], certs["tls_key"]))
        scaler = hpa(namespace, ONLINE_APP, HPA_TARGET, max_replicas=nodes * cores // replica_cores,
                     down_window_s=down_s)
    if offline:
        stand_in = NodeStandIn(rest, names, cores, reserve=config.reserve_cores, notice=notice,
                               window=config.window_minutes, buffer=config.buffer)
        stand_in.publish(stand_in.capacity({}, 0.0))
        jobs = OfflineJobs(rest, namespace, day_jobs(config, trace), node_names=names)
        # Tidal's scheduler places the offline pods: `tidal cluster scheduler`, as the chart runs it but for two
        # settings for the compressed day, said here: its backoff (1 s doubling to 10 s between tries of a
        # pod that did not fit) scaled to the day's clock as the rest of the day is (as shipped, 10 s would
        # be 100 day minutes); no preemption among offline pods, which the simulator's model has no
        # counterpart of (the scheduler tier tests both as shipped)
        scale = seconds_per_minute / 60.0
        scheduler = start_scheduler(plane, "--no-preemption", f"--pod-initial-backoff={BACKOFF_FIRST * scale:.6f}",
                                    f"--pod-max-backoff={BACKOFF_MAX * scale:.6f}")
    try:
        record = run_day(plane.api_client(), namespace, replicas, replica_cores, DayClock(seconds_per_minute),
                         lending, lending_period=lending_period, progress=progress, first_minute=-warmup,
                         nodes=stand_in, jobs=jobs, demand=predicted["demand_by_minute"], autoscaler=scaler,
                         metrics=metrics, metrics_gap=gap).day(warmup)
    finally:
        if metrics is not None:
            metrics.stop()
            metrics.unregister(rest)
        if scheduler is not None:
            scheduler.terminate()
            try:
                scheduler.wait(timeout=30)
            except subprocess.TimeoutExpired:
                scheduler.kill()
                scheduler.wait()
    report = {"nodes": nodes, "shape": shape["name"], "cores_per_node": cores, "seconds_per_minute": seconds_per_minute,
              "lending_period_minutes": lending_period, "threshold": threshold, "notice_minutes": config.notice_minutes,
              "real": record.summary(cores),
              "simulator": {"lent_node_hours": round(sum(offline_predicted) / 60.0, 2),
                            "lent_core_hours": round(sum(offline_predicted) * cores / 60.0, 1),
                            "unplaced_replica_minutes": predicted["unplaced_replica_minutes"],
                            "avg_util": predicted["avg_util"], "hourly_util": predicted["hourly_util"],
                            "offline_core_hours": round(float(sum(predicted["offline_busy_by_minute"][warmup:])) / 60.0, 1),
                            "offline_lost_core_hours": predicted["offline_lost_core_hours"],
                            "evictions_by_tier": predicted["evictions_by_tier"]},
              "separate_pools": {"avg_util": separate["avg_util"], "online_nodes": separate["online_nodes_at_peak"],
                                 "offline_core_hours": separate["offline_core_hours"]},
              "autoscaler": {"kind": "HorizontalPodAutoscaler", "scale_down_window_s": down_s,
                             "scale_down_window_minutes": config.hpa_down_minutes,
                             "tolerance": config.hpa_tolerance, "target": HPA_TARGET,
                             "metric_lists_served": metrics.requests, "metrics_gap": metrics_gap,
                             "fallback": fallback, "fallback_minutes": metrics.fallback_minutes,
                             "missing_minutes": metrics.missing_minutes} if metrics is not None else None,
              "replicas": compare_replicas(record.replicas, replicas[warmup:], config.hpa_tolerance if autoscaler else 0.0,
                                          lag=HPA_LAG_MINUTES if autoscaler else 0),
              "offline_labelled": compare(record.offline_labelled, offline_predicted),
              "offline_labelled_by_hour": {"real": record.offline_labelled[::60], "simulator": offline_predicted[::60]},
              "replicas_by_hour": {"real": record.replicas[::60], "simulator": replicas[warmup:][::60]}, "actions": record.actions, "evictions": record.evictions}
    return report

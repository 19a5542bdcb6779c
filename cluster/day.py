"""A day compressed onto a real cluster: the online replicas a day asks for, the shipped lending controller.

``tidal cluster simulate`` predicts a day from a model of each component. This module runs the same day's
online side on real ones and records what happened, minute by minute, for the two to be set side by side
(``compare``):

* an online Deployment (the Kubernetes deployment and replicaset controllers, the scheduler the cluster
  runs) scaled, each day minute, to the replicas the simulator's day asks for at that minute
  (``SimConfig``'s HPA rule on its demand curve: the series is the simulator's own, so that the two runs
  differ only where the components do);
* the lending controller (``cluster.lending``, as shipped: cordon, the Eviction API, the node-state
  label) every ``lending_period`` day minutes, on a ``DayClock``, the day compressed into
  ``seconds_per_minute`` of wall time each minute; its online windows read the day's clock.

Recorded per day minute: the nodes labelled Offline, the replicas asked for and those running on online
nodes. Left out here, and said so: the HorizontalPodAutoscaler itself (the replicas come from the
simulator's HPA rule), offline work on the lent nodes, and the node agents' notice (on KWOK nodes no agent
runs: a node is Offline as soon as it is labelled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from contracts.errors import TidalError
from contracts.states import OFFLINE, STATE_LABEL
from kube import timeouts

ONLINE_APP = "tidal-day-online"


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
    replicas: List[int] = field(default_factory=list)  # asked for, per day minute
    running: List[int] = field(default_factory=list)  # running on online nodes at the minute's sample
    unschedulable: List[int] = field(default_factory=list)  # pods the scheduler found no node for
    offline_labelled: List[int] = field(default_factory=list)  # nodes labelled Offline
    actions: List[str] = field(default_factory=list)  # "minute: action"
    late_minutes: float = 0.0  # the most the driver fell behind the day's clock
    wall_s: float = 0.0

    def day(self, skip: int) -> "DayRecord":
        """The record without its first ``skip`` minutes (a warmup), its actions still all listed."""
        return DayRecord(self.replicas[skip:], self.running[skip:], self.unschedulable[skip:],
                         self.offline_labelled[skip:], self.actions, self.late_minutes, self.wall_s)

    def summary(self, cores_per_node: float) -> Dict[str, Any]:
        short = [max(0, want - got) for want, got in zip(self.replicas, self.running)]
        return {"minutes": len(self.replicas), "lent_node_hours": round(sum(self.offline_labelled) / 60.0, 2),
                "lent_core_hours": round(sum(self.offline_labelled) * cores_per_node / 60.0, 1),
                "short_replica_minutes": sum(short), "minutes_short": sum(1 for s in short if s),
                "most_short": max(short, default=0),
                "unschedulable_replica_minutes": sum(self.unschedulable), "lending_actions": len(self.actions),
                "late_minutes": round(self.late_minutes, 2), "wall_s": round(self.wall_s, 1)}


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
            first_minute: int = 0) -> DayRecord:
    """The day (``replicas``: one figure per minute, the first being day minute ``first_minute``: negative
    for minutes before the day's midnight) on the cluster ``api_client`` reaches; ``lending``: a
    ``cluster.lending.LendingController`` (its ``step`` is called with the day clock's time)."""
    from kubernetes import client

    if lending_period < 1:
        raise DayError(f"lending period {lending_period}: at least one day minute")
    if not replicas:
        raise DayError("a day of no minutes")
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    apps.create_namespaced_deployment(namespace, deployment(namespace, int(replicas[0]), replica_cores, image,
                                                            {"tidal.io/day": "online"}, node_selector),
                                      _request_timeout=timeouts.CALL)
    # the day starts from the first minute's replicas all running, as a cluster in service would: a lending
    # pass over a Deployment still being created saw a fraction of its pods and lent a node at once
    deadline = time.monotonic() + 120
    while True:
        got = apps.read_namespaced_deployment(ONLINE_APP, namespace, _request_timeout=timeouts.CALL)
        if (got.status.ready_replicas or 0) >= int(replicas[0]) or time.monotonic() > deadline:
            if (got.status.ready_replicas or 0) < int(replicas[0]):
                raise DayError(f"the online Deployment had {got.status.ready_replicas or 0} of {int(replicas[0])} "
                               f"replicas ready after 120 s")
            break
        time.sleep(0.2)
    clock.reset()
    record, current, started = DayRecord(), int(replicas[0]), time.monotonic()
    for minute, want in enumerate(int(r) for r in replicas):
        record.late_minutes = max(record.late_minutes, clock.wait_until(minute))
        if want != current:
            apps.patch_namespaced_deployment_scale(ONLINE_APP, namespace, {"spec": {"replicas": want}},
                                                   _request_timeout=timeouts.CALL)
            current = want
        day_minute = first_minute + minute
        if day_minute % lending_period == 0:
            for action in lending.step(now=clock.epoch(day_minute)):
                record.actions.append(f"{day_minute}: {action}")
        nodes = core.list_node(_request_timeout=timeouts.CALL).items
        offline = {n.metadata.name for n in nodes if (n.metadata.labels or {}).get(STATE_LABEL) == OFFLINE}
        pods = core.list_namespaced_pod(namespace, label_selector=f"app={ONLINE_APP}", _request_timeout=timeouts.CALL).items
        running = sum(1 for p in pods if p.status.phase == "Running" and p.spec.node_name
                      and p.spec.node_name not in offline and p.metadata.deletion_timestamp is None)
        unschedulable = sum(1 for p in pods if not p.spec.node_name and any(
            c.type == "PodScheduled" and c.reason == "Unschedulable" for c in (p.status.conditions or [])))
        record.replicas.append(want)
        record.running.append(running)
        record.unschedulable.append(unschedulable)
        record.offline_labelled.append(len(offline))
        if day_minute % 60 == 0:
            progress(f"{'warmup ' if day_minute < 0 else ''}{(day_minute // 60) % 24:02d}:00 replicas {want} "
                     f"(running {running}), {len(offline)} node(s) lent")
    record.wall_s = time.monotonic() - started
    return record


def compare(real: Sequence[int], predicted: Sequence[int]) -> Dict[str, Any]:
    """Nodes labelled Offline, minute by minute, the real run against the simulator's."""
    if len(real) != len(predicted):
        raise DayError(f"{len(real)} real minutes against {len(predicted)} predicted")
    differ = [m for m, (a, b) in enumerate(zip(real, predicted)) if a != b]
    return {"real_node_minutes": int(sum(real)), "predicted_node_minutes": int(sum(predicted)),
            "minutes_that_differ": len(differ), "first_differ": differ[:10],
            "most_apart": max((abs(a - b) for a, b in zip(real, predicted)), default=0)}


def bench(plane, fleet, shape: Dict[str, Any], nodes: int = 6, seconds_per_minute: float = 0.1,
          lending_period: int = 30, hours: float = 24.0, online_peak_share: float = 0.5, replica_cores: int = 2,
          threshold: float = 0.9, namespace: str = "tidal-day",
          progress: Callable[[str], None] = lambda _: None) -> Dict[str, Any]:
    """The simulator's day for ``nodes`` machines of ``shape``, then the same day on ``plane`` (its deployment
    and replicaset controllers and a scheduler running) over KWOK nodes of that shape (``fleet``, KWOK
    started): the report of both and where they part."""
    from cluster.lending import LendingController
    from cluster.simulate import SimConfig, run as simulate_run

    cores = int(shape["allocatable"]["cpu"])
    # noise 0: the replicas are the demand curve's own; notice 0: no agent serves a notice on a KWOK node
    config = SimConfig(nodes=nodes, cores=cores, hours=hours, noise=0.0, online_peak_share=online_peak_share,
                       replica_cores=replica_cores, lending_threshold=threshold,
                       lending_period_s=lending_period * 60.0, notice_minutes=0)
    predicted = simulate_run(config, "tidal")
    # both runs start at the simulator's warmup (its nodes unlent, its queues empty) and are compared over the day
    warmup = predicted["warmup_minutes"]
    replicas = [int(r) for r in predicted["replicas_by_minute"]]
    offline_predicted = [int(n) for n in predicted["offline_labelled_by_minute"]][warmup:]
    fleet.namespace(namespace)
    names = fleet.add_nodes(nodes, [shape], prefix=f"{namespace}-", reports=True)
    fleet.wait_ready(names, timeout=120)
    progress(f"{nodes} nodes of {shape['name']} ({cores} cpus each) Ready; the day (and {warmup} minutes before "
             f"it) in {len(replicas) * seconds_per_minute:.0f} s")
    lending = LendingController(plane.api_client(), threshold=threshold, echo=lambda _: None)
    record = run_day(plane.api_client(), namespace, replicas, replica_cores, DayClock(seconds_per_minute), lending,
                     lending_period=lending_period, progress=progress, first_minute=-warmup).day(warmup)
    return {"nodes": nodes, "shape": shape["name"], "cores_per_node": cores, "seconds_per_minute": seconds_per_minute,
            "lending_period_minutes": lending_period, "threshold": threshold,
            "real": record.summary(cores),
            "simulator": {"lent_node_hours": round(sum(offline_predicted) / 60.0, 2),
                          "lent_core_hours": round(sum(offline_predicted) * cores / 60.0, 1),
                          "unplaced_replica_minutes": predicted["unplaced_replica_minutes"],
                          "avg_util": predicted["avg_util"]},
            "offline_labelled": compare(record.offline_labelled, offline_predicted),
            "offline_labelled_by_hour": {"real": record.offline_labelled[::60], "simulator": offline_predicted[::60]},
            "replicas_by_hour": replicas[::60], "actions": record.actions}


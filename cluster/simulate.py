"""A day of a cluster, minute by minute: what colocation buys, and what it risks.

Model (every number a ``SimConfig`` field):

* **Online services** follow a tidal curve: a valley (``valley_ratio`` of the
  peak, at ``valley_hour``) rising to the evening peak (``peak_hour``) and
  back, cosine-shaped on each side; the peak is ``online_peak_share`` of the
  cluster's cores. Each node's share wobbles by up to ``noise`` every minute.
  Replicas (``replica_cores`` requested each) scale as Kubernetes' HPA does on
  utilisation: up at once to demand / (request x ``hpa_target``), down only
  after ``hpa_down_minutes`` of lower demand, and not at all while the use is
  within ``hpa_tolerance`` (10%, the HPA's default) of the target.
* **Offline jobs** arrive continuously (Poisson; ``offline_demand_share`` of
  the cluster's cores on average), each with cores, a duration and a tier.
  Waiting jobs start highest tier first; when capacity shrinks, running jobs
  are evicted low, then min, then high tier, youngest first, and go back to
  the queue (their lost work is counted).
* **separate**: online gets a fixed pool sized for the day's peak requests at
  ``lending_threshold`` water level; offline gets the other nodes.
* **tidal**: every node runs online replicas (spread evenly over the online
  nodes), and offline may use, per node, the cores - reserve - estimated
  online use, the estimate being the node's peak over the last
  ``window_minutes`` x (1 + ``buffer``): the agents' headroom rule. When a
  node's online use rises above what offline left it, the kernel takes the
  cores back at once (the cpu quota shrinks in the agent's period,
  ``reaction_s``): online is short of the excess for that long, then the
  next estimate moves (``contracts.headroom``, the agents' own rule). The
  lending controller lends whole nodes to offline while the online water
  level (requested / allocatable of online nodes) stays under
  ``lending_threshold`` and takes them back above it, one node per
  ``lending_period_s`` (``cluster.lendrule``, the controller's own rule);
  each move takes ``notice_minutes`` (a node in transition takes neither new
  online replicas nor new offline work).
* **Online shortfall** (core-hours): demand that found no core: above its
  replicas' requests (the HPA lagged), on replicas that found no node (lending
  took too much), or taken back from offline too late (the reaction window).

Offline work is a fluid over each mode's offline capacity, except jobs that a
trace pins to a node, which wait for room on that node.

Trace files (``--trace``), CSV with a header line; one row per event::

    minute,kind,name,cores,duration_min,tier,node
    0,online,web,1200,,,                   # service web needs 1200 cores from minute 0 on
    0,offline,job-1,8,45,low,              # a job of 8 cores for 45 minutes, tier low
    3,offline,job-2,4,30,high,node-17      # pinned to node-17 (must exist)

``online`` rows set a service's demand (cores) from that minute until its next
row (the curve is then the sum of the services'); ``offline`` rows are job
arrivals. Errors name the line.
"""

from __future__ import annotations

import csv
from collections import deque
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from contracts.errors import TidalError
from cluster.lendrule import TAKE_BACK, OnlineNode, decide
from contracts.eviction import TIERS
from contracts.headroom import DEFAULT_BUFFER, online_estimate



class TraceError(TidalError):
    """A trace file line is malformed."""


@dataclass
class SimConfig:
    nodes: int = 1000
    cores: int = 64
    hours: float = 24.0
    seed: int = 1
    online_peak_share: float = 0.35
    valley_ratio: float = 0.3
    peak_hour: float = 20.0
    valley_hour: float = 4.0
    noise: float = 0.05
    replica_cores: int = 4
    hpa_target: float = 0.6
    hpa_down_minutes: int = 5
    hpa_tolerance: float = 0.1  # the HPA's (kube-controller-manager --horizontal-pod-autoscaler-tolerance)
    offline_demand_share: float = 0.6
    job_cores: Tuple[int, ...] = (1, 2, 4, 8)
    job_minutes: float = 30.0
    tier_weights: Tuple[float, float, float] = (0.2, 0.3, 0.5)
    buffer: float = DEFAULT_BUFFER
    window_minutes: int = 5
    reserve_cores: float = 1.0
    reaction_s: float = 1.0
    lending_threshold: float = 0.9
    lending_period_s: float = 30.0  # the lending controller's --period
    notice_minutes: int = 5
    lending: bool = True
    warmup_minutes: int = 180  # simulated before the day and not counted (offline queues fill, nodes get lent)

    def check(self) -> None:
        if self.nodes < 1 or self.cores < 1 or self.hours <= 0:
            raise TidalError("nodes, cores and hours must be positive")
        if not 0 < self.online_peak_share <= 1 or not 0 < self.valley_ratio <= 1:
            raise TidalError("online_peak_share and valley_ratio must be in (0, 1]")
        if self.buffer < 0 or self.noise < 0 or not 0 < self.hpa_target <= 1 or not 0 <= self.hpa_tolerance < 1:
            raise TidalError("buffer and noise must be >= 0, hpa_target in (0, 1], hpa_tolerance in [0, 1)")
        if self.hpa_down_minutes < 1:
            raise TidalError("hpa_down_minutes must be >= 1")
        if not 0 < self.lending_threshold <= 1:
            raise TidalError("lending_threshold must be in (0, 1]")
        if self.notice_minutes < 0 or self.lending_period_s <= 0:
            raise TidalError("notice_minutes must be >= 0 and lending_period_s > 0")


@dataclass(order=True)
class Job:
    arrival: int
    name: str = field(compare=False)
    cores: float = field(compare=False)
    minutes: float = field(compare=False)
    tier: str = field(compare=False)
    node: Optional[int] = field(default=None, compare=False)
    left: float = field(default=0.0, compare=False)
    started: int = field(default=-1, compare=False)


@dataclass
class Trace:
    online: Dict[str, List[Tuple[int, float]]]
    jobs: List[Job]


def read_trace(path: str, nodes: int) -> Trace:
    need = ["minute", "kind", "name", "cores", "duration_min", "tier", "node"]
    online: Dict[str, List[Tuple[int, float]]] = {}
    jobs: List[Job] = []
    try:
        handle = open(path, newline="")
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror}") from None
    with handle:
        try:
            return _read_rows(path, handle, nodes, need, online, jobs)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text (byte {exc.start})") from None
        except csv.Error as exc:
            raise TraceError(f"{path}: not a CSV trace ({exc})") from None


def _read_rows(path, handle, nodes, need, online, jobs) -> Trace:
    reader = csv.DictReader(handle)
    missing = [c for c in need if c not in (reader.fieldnames or [])]
    if missing:
        raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)} (need {','.join(need)})")
    for row in reader:
        line = reader.line_num
        where = f"{path}:{line}"
        try:
            minute = int(row["minute"])
            cores = float(row["cores"])
        except (TypeError, ValueError):
            raise TraceError(f"{where}: minute and cores must be numbers") from None
        if minute < 0:
            raise TraceError(f"{where}: minute {minute} is negative")
        if cores < 0 or math.isnan(cores):
            raise TraceError(f"{where}: negative demand ({cores} cores)")
        kind, name = (row["kind"] or "").strip(), (row["name"] or "").strip()
        if not name:
            raise TraceError(f"{where}: name is empty")
        if kind == "online":
            online.setdefault(name, []).append((minute, cores))
        elif kind == "offline":
            if cores == 0:
                raise TraceError(f"{where}: an offline job needs cores above zero")
            try:
                minutes = float(row["duration_min"])
            except (TypeError, ValueError):
                raise TraceError(f"{where}: duration_min must be a number for offline rows") from None
            if minutes <= 0:
                raise TraceError(f"{where}: duration_min must be above zero")
            tier = (row["tier"] or "low").strip()
            if tier not in TIERS:
                raise TraceError(f"{where}: tier {tier!r} is not one of {', '.join(TIERS)}")
            node = None
            if (row["node"] or "").strip():
                label = row["node"].strip()
                number = label[5:] if label.startswith("node-") else ""
                if not number.isdigit() or int(number) >= nodes:
                    raise TraceError(f"{where}: unknown node id {label!r} (the cluster has node-0 .. "
                                     f"node-{nodes - 1})")
                node = int(number)
            jobs.append(Job(minute, name, cores, minutes, tier, node))
        else:
            raise TraceError(f"{where}: kind {kind!r}: expected online or offline")
    for points in online.values():
        points.sort()
    return Trace(online, sorted(jobs))


def diurnal(config: SimConfig, minute: np.ndarray) -> np.ndarray:
    """Online demand as a share of its peak: valley_ratio at valley_hour, 1 at peak_hour."""
    hour = (minute / 60.0) % 24.0
    rise = (config.peak_hour - config.valley_hour) % 24.0 or 24.0
    since_valley = (hour - config.valley_hour) % 24.0
    phase = np.where(since_valley <= rise, since_valley / rise, 1.0 - (since_valley - rise) / (24.0 - rise))
    return config.valley_ratio + (1.0 - config.valley_ratio) * (1.0 - np.cos(np.pi * phase)) / 2.0


def _synthetic_jobs(config: SimConfig, minutes: int, rng: random.Random) -> List[Job]:
    mean_cores = sum(config.job_cores) / len(config.job_cores)
    per_minute = config.offline_demand_share * config.nodes * config.cores / (mean_cores * config.job_minutes)
    jobs = []
    for minute in range(minutes):
        n = np.random.default_rng(rng.randrange(2 ** 32)).poisson(per_minute)
        for i in range(n):
            jobs.append(Job(minute, f"job-{minute}-{i}", rng.choice(config.job_cores),
                            max(1.0, rng.expovariate(1.0 / config.job_minutes)),
                            rng.choices(TIERS, config.tier_weights)[0]))
    return jobs


FUTURE, QUEUED, RUNNING, DONE = 0, 1, 2, 3


class _Offline:
    """Offline jobs over a capacity that changes every minute (arrays: one entry per job)."""

    def __init__(self, jobs: List[Job], nodes: int) -> None:
        jobs = sorted(jobs)
        self.cores = np.array([j.cores for j in jobs], dtype=np.float64)
        self.minutes = np.array([j.minutes for j in jobs], dtype=np.float64)
        self.tier = np.array([TIERS.index(j.tier) for j in jobs], dtype=np.int64)
        self.node = np.array([-1 if j.node is None else j.node for j in jobs], dtype=np.int64)
        self.arrival = np.array([j.arrival for j in jobs], dtype=np.int64)
        self.left = self.minutes.copy()
        self.started = np.full(len(jobs), -1, dtype=np.int64)
        self.state = np.zeros(len(jobs), dtype=np.int8)
        self.next_arrival = 0
        self.pinned = bool((self.node >= 0).any())
        self.nodes = nodes
        self.core_minutes = 0.0
        self.lost_core_minutes = 0.0
        self.evictions = {t: 0 for t in TIERS}

    def _evict(self, idx: np.ndarray) -> None:
        if idx.size == 0:
            return
        for tier, count in zip(*np.unique(self.tier[idx], return_counts=True)):
            self.evictions[TIERS[tier]] += int(count)
        self.lost_core_minutes += float((self.cores[idx] * (self.minutes[idx] - self.left[idx])).sum())
        self.left[idx] = self.minutes[idx]
        self.started[idx] = -1
        self.state[idx] = QUEUED

    def step(self, minute: int, capacity: float, node_capacity: np.ndarray) -> float:
        end = int(np.searchsorted(self.arrival, minute, side="right"))
        self.state[self.next_arrival:end] = QUEUED
        self.next_arrival = end
        running = np.flatnonzero(self.state == RUNNING)
        pinned_use = np.zeros(self.nodes)
        if self.pinned:  # jobs pinned to a node take its room first (few: a Python loop)
            for i in running[self.node[running] >= 0]:
                n = self.node[i]
                if pinned_use[n] + self.cores[i] <= node_capacity[n] + 1e-9:
                    pinned_use[n] += self.cores[i]
                else:
                    self._evict(np.array([i]))
            running = np.flatnonzero((self.state == RUNNING) & (self.node < 0))
        pool = max(0.0, capacity - pinned_use.sum())
        # keep high tier and old first; evict the rest (low, then min, then high; youngest first)
        order = running[np.lexsort((self.started[running], self.tier[running]))]
        fits = np.cumsum(self.cores[order]) <= pool + 1e-9
        self._evict(order[~fits])
        used = float(self.cores[order[fits]].sum())
        queued = np.flatnonzero(self.state == QUEUED)
        if self.pinned:
            for i in queued[self.node[queued] >= 0]:
                n = self.node[i]
                if pinned_use[n] + self.cores[i] <= node_capacity[n] + 1e-9 and \
                        used + pinned_use.sum() + self.cores[i] <= capacity + 1e-9:
                    pinned_use[n] += self.cores[i]
                    self.state[i], self.started[i] = RUNNING, minute
            queued = queued[self.node[queued] < 0]
        free = max(0.0, capacity - pinned_use.sum() - used)
        order = queued[np.lexsort((self.arrival[queued], self.tier[queued]))]
        start = order[np.cumsum(self.cores[order]) <= free + 1e-9]
        self.state[start], self.started[start] = RUNNING, minute
        running = np.flatnonzero(self.state == RUNNING)
        busy = float(self.cores[running].sum())
        self.core_minutes += busy
        self.left[running] -= 1
        self.state[running[self.left[running] <= 0]] = DONE
        return busy


def day_jobs(config: SimConfig, trace: Optional[Trace] = None) -> List[Job]:
    """The offline jobs of a run: the trace's, or the synthetic stream (arrival minutes counted from the
    warmup's first minute), fresh copies each call."""
    if trace is not None and trace.jobs:
        jobs = trace.jobs
    else:
        minutes = int(round(config.hours * 60)) + (0 if trace is not None else config.warmup_minutes)
        jobs = _synthetic_jobs(config, minutes, random.Random(config.seed))
    return [Job(j.arrival, j.name, j.cores, j.minutes, j.tier, j.node) for j in jobs]


def _online_demand(config: SimConfig, minutes: int, trace: Optional[Trace], warmup: int = 0) -> np.ndarray:
    """Cluster-wide online demand (cores) per minute (the synthetic day starts ``warmup`` minutes early)."""
    if trace is None or not trace.online:
        peak = config.online_peak_share * config.nodes * config.cores
        return peak * diurnal(config, np.arange(minutes) - warmup)
    demand = np.zeros(minutes)
    for points in trace.online.values():
        series = np.zeros(minutes)
        for (start, cores), nxt in zip(points, points[1:] + [(minutes, 0.0)]):
            series[min(start, minutes):min(nxt[0], minutes)] = cores
        demand += series
    return demand


def _replicas(config: SimConfig, demand: np.ndarray) -> np.ndarray:
    """The HorizontalPodAutoscaler's rule once a minute, as Kubernetes' replica calculator and its
    stabilisation apply it: the recommendation is demand / (request x target) rounded up, or the replicas
    there are while their use is within ``hpa_tolerance`` of the target; up at once to it, down only to the
    highest recommendation of the last ``hpa_down_minutes``. (With no tolerance: a running max of the
    demand's replicas over the window.)"""
    want = np.ceil(demand / (config.replica_cores * config.hpa_target))
    out = np.empty_like(want)
    recent: Deque[float] = deque(maxlen=config.hpa_down_minutes)
    current = float(want[0]) if len(want) else 0.0
    for t in range(len(want)):
        asked = current * config.replica_cores * config.hpa_target
        inside = asked > 0 and abs(demand[t] / asked - 1.0) <= config.hpa_tolerance
        recommended = current if inside else float(want[t])
        recent.append(recommended)
        if recommended > current:
            current = recommended
        elif current > max(recent):
            current = max(recent)
        out[t] = current
    return out


def run(config: SimConfig, mode: str, trace: Optional[Trace] = None) -> Dict[str, Any]:
    config.check()
    day = int(round(config.hours * 60))
    warmup = 0 if trace is not None else config.warmup_minutes
    minutes = warmup + day
    noise_rng = np.random.default_rng(config.seed + 1)
    offline = _Offline(day_jobs(config, trace), config.nodes)
    demand = _online_demand(config, minutes, trace, warmup)
    replicas = _replicas(config, demand)
    n, cores = config.nodes, float(config.cores)
    total = n * cores
    threshold = config.lending_threshold
    peak_requests = float((replicas * config.replica_cores).max())
    separate_online = min(n, max(1, math.ceil(peak_requests / (cores * threshold))))
    # tidal: node states as countdowns: 0 online, >0 minutes to Offline (lending), <0 minutes to Online
    lent = np.zeros(n, dtype=bool)
    moving = np.zeros(n, dtype=np.int64)  # minutes left of a transition (0: none)
    history = np.zeros((config.window_minutes, n))
    util = np.zeros(minutes)
    offline_busy = np.zeros(minutes)  # cores offline jobs ran on, per minute (from the warmup's first)
    shortfall = 0.0
    parts = {"unplaced": 0.0, "over_node": 0.0, "reaction": 0.0}
    events = 0  # node-minutes in which online waited for cores
    lent_node_minutes = 0.0
    online_before = np.zeros(n, dtype=bool)
    labelled_offline = np.zeros(minutes, dtype=np.int64)  # nodes the controller has labelled Offline
    # replicas are whole pods: a node holds as many as fit whole (7 of 2 cores on a 15-core node), the cores
    # left over are not online's (a real day on KWOK nodes left replicas unschedulable where cores alone fit)
    per_node_fit = (config.cores // config.replica_cores) * config.replica_cores
    unplaced_replica_minutes = 0.0
    for t in range(minutes):
        if t == warmup and warmup:  # the day starts: count from here
            parts = dict.fromkeys(parts, 0.0)
            events, lent_node_minutes, unplaced_replica_minutes = 0, 0.0, 0.0
            offline.core_minutes = offline.lost_core_minutes = 0.0
            offline.evictions = dict.fromkeys(offline.evictions, 0)
        wobble = 1.0 + noise_rng.uniform(-config.noise, config.noise, n)
        requested = replicas[t] * config.replica_cores
        if mode == "separate":
            online_nodes = np.arange(separate_online)
            offline_capacity = (n - separate_online) * cores
            node_capacity = np.zeros(n)
            node_capacity[separate_online:] = cores
            placed_requests = min(requested, separate_online * per_node_fit)
        else:
            if config.lending:
                _lend_or_take_back(config, lent, moving, requested, t)
            labelled_offline[t] = int(((moving > 0) | (lent & (moving == 0))).sum())
            # online: online nodes and nodes in their lending notice (they keep their replicas until it ends)
            online_nodes = np.flatnonzero((~lent & (moving == 0)) | (moving > 0))
            placed_requests = min(requested, len(online_nodes) * per_node_fit)
        unplaced_replica_minutes += (requested - placed_requests) / config.replica_cores
        # online use on its nodes: the demand spread with each node's wobble, capped by requests and cores
        served = min(demand[t], placed_requests)
        parts["unplaced"] += (demand[t] - served) / 60.0
        use = np.zeros(n)
        if len(online_nodes):
            use[online_nodes] = served / len(online_nodes) * wobble[online_nodes]
        over = np.maximum(0.0, use - cores)
        parts["over_node"] += over.sum() / 60.0
        use = np.minimum(use, cores)
        if mode == "tidal":
            # the agents' rule: peak use per requested core over the window, times the requests the
            # node holds now (replicas moved in by lending count at once), times (1 + buffer)
            per_node_requests = placed_requests / len(online_nodes) if len(online_nodes) else 0.0
            ratio_peak = history.max(axis=0)
            fresh = np.zeros(n, dtype=bool)
            fresh[online_nodes] = True
            fresh &= ~online_before  # no use of its own yet (back from lending): requests stand in
            ratio_peak[fresh] = np.maximum(ratio_peak[fresh], 1.0)
            estimate = online_estimate(ratio_peak * per_node_requests, config.buffer)  # THE headroom rule
            online_before = np.zeros(n, dtype=bool)
            online_before[online_nodes] = True
            node_capacity = np.zeros(n)
            node_capacity[online_nodes] = np.maximum(0.0, cores - config.reserve_cores - estimate[online_nodes])
            lent_now = lent  # lent, or being taken back: offline keeps running through the notice
            node_capacity[lent_now] = cores - config.reserve_cores
            lent_node_minutes += lent_now.sum()
            # online rose above what offline left it: the kernel takes it back within reaction_s
            excess = np.maximum(0.0, use - (cores - node_capacity))
            late = np.minimum(excess, node_capacity)
            parts["reaction"] += late.sum() * config.reaction_s / 3600.0
            events += int((late > 1e-9).sum())
            history = np.roll(history, 1, axis=0)
            history[0] = use / per_node_requests if per_node_requests else 0.0
            offline_capacity = float(node_capacity.sum())
        busy = offline.step(t, offline_capacity, node_capacity)
        offline_busy[t] = busy
        util[t] = (use.sum() + busy) / total
    shortfall = sum(parts.values())
    util = util[warmup:]
    hourly = [round(float(util[h * 60:(h + 1) * 60].mean()), 4) for h in range(max(1, day // 60))]
    return {"avg_util": round(float(util.mean()), 4), "online_shortfall_core_hours": round(shortfall, 3),
            "online_shortfall_by_cause": {k: round(v, 3) for k, v in parts.items()},
            "online_waits_node_minutes": events,
            "unplaced_replica_minutes": round(unplaced_replica_minutes, 1),
            "offline_core_hours": round(offline.core_minutes / 60.0, 1),
            "offline_lost_core_hours": round(offline.lost_core_minutes / 60.0, 1),
            "evictions_by_tier": dict(offline.evictions), "hourly_util": hourly,
            "online_nodes_at_peak": separate_online if mode == "separate" else None,
            "lent_node_hours": round(lent_node_minutes / 60.0, 1) if mode == "tidal" else 0.0,
            "util_by_minute": util, "warmup_minutes": warmup,
            # from the warmup's first minute: a real run of the same day starts where the simulator did
            "replicas_by_minute": replicas.astype(int), "offline_labelled_by_minute": labelled_offline,
            "demand_by_minute": demand, "offline_busy_by_minute": offline_busy}


def _lend_or_take_back(config: SimConfig, lent: np.ndarray, moving: np.ndarray, requested: float,
                       minute: int = 0) -> None:
    """One minute of the lending controller: THE lending rule (``cluster.lendrule.decide``), run as
    often as the controller runs it (every ``lending_period_s``: several times a minute, or in the
    minutes that start a period when it is a minute or longer), on the nodes as it sees them.

    ``lent``: the node is Offline (or OfflineToOnline); ``moving`` > 0: minutes left of an
    OnlineToOffline notice, < 0: of an OfflineToOnline notice. The controller sees a node in its
    lending notice as lent (it is labelled Offline) and one being taken back as online (labelled
    Online, uncordoned); replicas are spread evenly, so every online node holds as many pods."""
    ending = moving == 1
    returning = moving == -1
    moving[moving > 0] -= 1
    moving[moving < 0] += 1
    lent[ending] = True
    lent[returning] = False
    cores = float(config.cores)
    every = max(1, round(config.lending_period_s / 60.0))  # minutes between the controller's periods
    if minute % every:
        return
    for _ in range(max(1, round(60.0 / config.lending_period_s))):
        labelled_online = (~lent & (moving == 0)) | (moving < 0)
        going = np.flatnonzero(moving > 0)
        away = np.flatnonzero(lent & (moving == 0))
        online = [OnlineNode(f"{i:07d}", cores, 0) for i in np.flatnonzero(labelled_online)]
        order = [(f"{i:07d}", cores) for i in (*going, *away)]  # called off during its notice first
        actions = decide(requested, online, order, config.lending_threshold)
        if not actions:
            return
        for action in actions:
            node = int(action.node)
            if action.kind == TAKE_BACK:
                if moving[node] > 0:  # called off during its lending notice: online at once
                    moving[node] = 0
                elif config.notice_minutes:
                    moving[node] = -config.notice_minutes
                else:
                    lent[node] = False
            elif config.notice_minutes:
                moving[node] = config.notice_minutes
            else:  # no notice: lent as it is labelled
                lent[node] = True


def simulate(config: SimConfig, trace: Optional[Trace] = None) -> Dict[str, Any]:
    separate = run(config, "separate", trace)
    tidal = run(config, "tidal", trace)
    series = {"separate": separate.pop("util_by_minute"), "tidal": tidal.pop("util_by_minute"),
              "replicas": tidal.pop("replicas_by_minute"), "offline_labelled": tidal.pop("offline_labelled_by_minute")}
    for key in ("replicas_by_minute", "offline_labelled_by_minute", "warmup_minutes", "demand_by_minute",
                "offline_busy_by_minute"):
        separate.pop(key)
    for key in ("warmup_minutes", "demand_by_minute", "offline_busy_by_minute"):
        tidal.pop(key)
    return {"separate": separate, "tidal": tidal, "gain": round(tidal["avg_util"] - separate["avg_util"], 4),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
            "_series": series}


def plot(result: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TidalError("--plot needs matplotlib (pip install 'tidal[plot]')") from None
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for name, style in (("separate", "--"), ("tidal", "-")):
        series = result["_series"][name]
        hours = np.arange(len(series)) / 60.0
        ax.plot(hours, series * 100, style, label=f"{name} (avg {result[name]['avg_util'] * 100:.1f}%)")
    ax.set_xlabel("hour of day")
    ax.set_ylabel("cluster cpu utilisation (%)")
    ax.set_ylim(0, 100)
    ax.set_xlim(0, len(result["_series"]["tidal"]) / 60.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    cfg = result["config"]
    ax.set_title(f"{cfg['nodes']} nodes x {cfg['cores']} cores: separate pools vs Tidal colocation")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

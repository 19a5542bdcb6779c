"""The node side and the offline work of a compressed day on KWOK nodes (``cluster.day``).

No agent runs on a KWOK node (no kernel, no usage), so the day runs ``NodeStandIn`` in its place, once a day
minute, deciding with the agents' own rules:

* **lending state**: the node follows its ``tidal.io/node-state`` label as ``agent.k8s.node`` does: Online ->
  OnlineToOffline for ``notice`` minutes -> Offline; Offline -> OfflineToOnline for the notice -> Online; a
  take-back during a lending notice calls it off at once. The state is written where the agent writes it
  (the ``tidal.io/node-state-current`` annotation), which Tidal's scheduler reads: a node in a transition
  takes no new work.
* **reclaimed capacity**: a lent node (Offline, and OfflineToOnline: offline work keeps the machine through
  its notice) offers everything but the reserve; an online one what THE headroom rule
  (``contracts.headroom``) leaves: cores - reserve - (its peak use per requested core over ``window``
  minutes x the cpu its online pods request now) x (1 + buffer), where a node just back from lending has
  no use of its own yet and its requests stand in. Online use is the day's demand shared by the online
  replicas running (each uses demand / their requests of its request). Published as the agent publishes
  it, the node's allocatable ``tidal.io/reclaimed-millicpu``, in whole cores (offline jobs ask whole
  cores; a fraction would be a node patch a minute for nothing).
* **eviction**: offline pods whose requests exceed the node's capacity go by the agents' rule
  (``contracts.eviction``: tier low, then min, then high, youngest first), at once (the
  simulator's rule; the agent's 10 s of throttling first would be 100 day minutes here), cause ``lending``
  where a take-back notice ended this minute, ``cpu`` otherwise.

``OfflineJobs`` runs the simulator's offline jobs as pods: each created at its arrival minute, a
``reclaimed_cores`` pod asking ``tidal.io/reclaimed-millicpu`` for its cores, its tier annotated, tolerating
a lent node's cordon, for Tidal's scheduler; finished (deleted: a finished job's pod holds nothing) once it
has been bound for its minutes; an evicted one is created again (a Job controller's retry), its work so far
lost. One of its pods that disappears otherwise was killed by something other than its node's agent (a
controller, a scheduler): counted as killed outside a notice, and created again.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, Optional, Sequence, Tuple

from contracts.eviction import TIERS, choose_victims
from contracts.headroom import DEFAULT_BUFFER, online_estimate
from contracts.states import CURRENT_ANNOTATION, OFFLINE, ONLINE, RECLAIMED_CPU, STATE_LABEL, TO_OFFLINE, TO_ONLINE

OFFLINE_APP = "tidal-day-offline"
TIER_ANNOTATION = "tidal.io/tier"
JOB_LABEL = "tidal.io/day-job"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"


@dataclass
class _Node:
    state: str = ONLINE
    until: int = 0  # the minute the running notice ends
    history: Deque[float] = field(default_factory=deque)  # use per requested core, newest last
    was_online: bool = True
    published: Optional[int] = None  # millicpu
    annotated: Optional[str] = None


class NodeStandIn:
    def __init__(self, rest, names: Sequence[str], cores: float, reserve: float = 1.0, notice: int = 5,
                 window: int = 5, buffer: float = DEFAULT_BUFFER) -> None:
        self.rest = rest
        self.cores, self.reserve, self.notice, self.window, self.buffer = float(cores), reserve, notice, window, buffer
        self.nodes: Dict[str, _Node] = {n: _Node(history=deque(maxlen=window)) for n in names}

    def state(self, name: str) -> str:
        return self.nodes[name].state

    def follow(self, minute: int, labels: Dict[str, str]) -> List[str]:
        """The lending state machines a minute on: notices that end, then the labels. Returns the nodes
        whose take-back notice ended this minute."""
        ended = []
        for name, node in self.nodes.items():
            if node.state == TO_OFFLINE and minute >= node.until:
                node.state = OFFLINE
            elif node.state == TO_ONLINE and minute >= node.until:
                node.state = ONLINE
                ended.append(name)
            want = labels.get(name, ONLINE)
            if want == OFFLINE and node.state == ONLINE:
                node.state, node.until = (TO_OFFLINE, minute + self.notice) if self.notice else (OFFLINE, minute)
            elif want == ONLINE and node.state == TO_OFFLINE:
                node.state = ONLINE  # called off during its notice
            elif want == ONLINE and node.state == OFFLINE:
                node.state, node.until = (TO_ONLINE, minute + self.notice) if self.notice else (ONLINE, minute)
                if not self.notice:
                    ended.append(name)
        return ended

    def capacity(self, requests: Dict[str, float], use_ratio: float) -> Dict[str, int]:
        """Each node's reclaimed capacity (millicpu) this minute. ``requests``: the cpu (cores) the online
        pods running on each node request; ``use_ratio``: what they use per requested core."""
        out = {}
        for name, node in self.nodes.items():
            lent = node.state in (OFFLINE, TO_ONLINE)
            if lent:
                free = self.cores - self.reserve
            else:
                peak = max(node.history, default=0.0)
                if not node.was_online:  # back from lending: no use of its own yet, its requests stand in
                    peak = max(peak, 1.0)
                free = max(0.0, self.cores - self.reserve - online_estimate(peak * requests.get(name, 0.0),
                                                                            self.buffer))
            node.was_online = not lent
            node.history.append(0.0 if lent else use_ratio)
            out[name] = int(free * 1000)
        return out

    def publish(self, capacity: Dict[str, int]) -> int:
        """Writes what changed (whole cores, and the state annotation); returns the writes made."""
        writes = 0
        for name, node in self.nodes.items():
            whole = capacity[name] // 1000 * 1000
            if whole != node.published:
                figure = {RECLAIMED_CPU: f"{whole}m"}
                self.rest.json("PATCH", f"/api/v1/nodes/{name}/status",
                               {"status": {"capacity": figure, "allocatable": figure}},
                               content_type="application/strategic-merge-patch+json")
                node.published = whole
                writes += 1
            if node.state != node.annotated:
                self.rest.json("PATCH", f"/api/v1/nodes/{name}",
                               {"metadata": {"annotations": {CURRENT_ANNOTATION: node.state}}},
                               content_type="application/strategic-merge-patch+json")
                node.annotated = node.state
                writes += 1
        return writes


@dataclass
class _Pod:
    job: int
    attempt: int
    bound: Optional[int] = None  # the minute it was first seen on a node
    node: Optional[str] = None


class OfflineJobs:
    """The simulator's offline jobs (``cluster.simulate.Job``) as pods through the day."""

    def __init__(self, rest, namespace: str, jobs: Sequence, scheduler: str = "tidal-scheduler",
                 image: str = "registry.k8s.io/pause:3.10", node_names: Sequence[str] = ()) -> None:
        """``node_names``: the nodes a trace's pinned job (``Job.node``, an index) may name."""
        self.rest, self.namespace, self.scheduler, self.image = rest, namespace, scheduler, image
        self.node_names = list(node_names)
        self.jobs = sorted(jobs, key=lambda j: j.arrival)
        self.next = 0
        self.retry: List[int] = []  # jobs to create again (evicted, or killed)
        self.attempts: Dict[int, int] = {}
        self.pods: Dict[str, _Pod] = {}  # ours, alive
        self.reset()

    def reset(self) -> None:
        """Counts from here (the day's first minute, after the warmup)."""
        self.core_minutes = 0.0
        self.lost_core_minutes = 0.0
        self.completed = {t: 0 for t in TIERS}
        self.evicted = {"cpu": {t: 0 for t in TIERS}, "lending": {t: 0 for t in TIERS}}
        self.evicted_fresh = 0  # evictions of a pod bound this minute or the one before (its work lost: ~nothing)
        self.killed_outside_notice: List[str] = []  # "minute: pod on node (state)"
        self.pinned_elsewhere: List[str] = []  # "pod on node": a pinned job's pod bound to another node
        self.created = 0

    def _create(self, index: int) -> None:
        job = self.jobs[index]
        attempt = self.attempts.get(index, 0)
        self.attempts[index] = attempt + 1
        name = f"job-{index}-{attempt}"
        millicpu = f"{int(round(job.cores * 1000))}m"
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "labels": {"app": OFFLINE_APP, JOB_LABEL: str(index)},
                             "annotations": {TIER_ANNOTATION: job.tier}},
                "spec": {"schedulerName": self.scheduler, "terminationGracePeriodSeconds": 0,
                         "tolerations": [{"key": UNSCHEDULABLE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                         "containers": [{"name": "task", "image": self.image,
                                         "resources": {"requests": {RECLAIMED_CPU: millicpu},
                                                       "limits": {RECLAIMED_CPU: millicpu}}}]}}
        if job.node is not None:  # a trace's job pinned to one node waits for room there
            if not 0 <= job.node < len(self.node_names):
                raise ValueError(f"job {job.name!r} is pinned to node-{job.node}: the day has {len(self.node_names)} nodes")
            body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.node_names[job.node]}
        self.rest.json("POST", f"/api/v1/namespaces/{self.namespace}/pods", body)
        self.pods[name] = _Pod(index, attempt)
        self.created += 1

    def arrive(self, minute: int) -> int:
        """Creates the pods of the jobs that arrive by ``minute`` and of those to run again."""
        made = 0
        while self.retry:
            self._create(self.retry.pop(0))
            made += 1
        while self.next < len(self.jobs) and self.jobs[self.next].arrival <= minute:
            self._create(self.next)
            self.next += 1
            made += 1
        return made

    def _delete(self, name: str) -> None:
        self.rest.json("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}", {"gracePeriodSeconds": 0},
                       ok=(200, 202, 404))
        self.pods.pop(name, None)

    def observe(self, minute: int, listed: Iterable[dict], states: Dict[str, str]) -> None:
        """The pods as the API server has them: which are bound where; ours that are gone without our
        word were killed outside a notice (created again)."""
        seen = {}
        for pod in listed:
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            seen[meta.get("name")] = (pod.get("spec") or {}).get("nodeName")
        for name, tracked in list(self.pods.items()):
            if name not in seen:
                where = tracked.node or "no node"
                self.killed_outside_notice.append(f"{minute}: {name} on {where} ({states.get(where, '-')})")
                self._lose(tracked, minute)
                self.pods.pop(name)
                self.retry.append(tracked.job)
                continue
            node = seen[name]
            if node and tracked.bound is None:
                tracked.bound, tracked.node = minute, node
                pin = self.jobs[tracked.job].node
                if pin is not None and self.node_names[pin] != node:
                    self.pinned_elsewhere.append(f"{name} on {node}")

    def _lose(self, tracked: _Pod, minute: int) -> None:
        if tracked.bound is not None:
            self.lost_core_minutes += self.jobs[tracked.job].cores * (minute - tracked.bound)

    def by_node(self) -> Dict[str, List[Tuple[str, _Pod]]]:
        out: Dict[str, List[Tuple[str, _Pod]]] = {}
        for name, tracked in self.pods.items():
            if tracked.node:
                out.setdefault(tracked.node, []).append((name, tracked))
        return out

    def evict(self, minute: int, capacity: Dict[str, int], notice_ended: Sequence[str]) -> List[str]:
        """On each node, the offline pods its capacity no longer holds, in the agent's order."""
        said = []
        for node, pods in sorted(self.by_node().items()):
            pods.sort(key=lambda p: (p[1].bound, p[0]))  # admission order: the youngest last
            victims = choose_victims([(name, self.jobs[t.job].tier, int(round(self.jobs[t.job].cores * 1000)))
                                      for name, t in pods], capacity.get(node, 0),
                                     tier=lambda p: p[1], millicpu=lambda p: p[2])
            cause = "lending" if node in notice_ended else "cpu"
            for name, tier, _ in victims:
                tracked = self.pods[name]
                self.evicted[cause][tier] += 1
                self.evicted_fresh += int(minute - tracked.bound <= 1)
                self._lose(tracked, minute)
                self._delete(name)
                self.retry.append(tracked.job)
            if victims:
                said.append(f"{minute}: {node} evicts {len(victims)} offline pod(s) ({cause})")
        return said

    def run_minute(self, minute: int) -> Dict[str, float]:
        """The minute's work on the pods still bound: counted, and those whose minutes are done finish.
        Returns the cores offline work ran on, per node."""
        busy: Dict[str, float] = {}
        for name, tracked in list(self.pods.items()):
            if tracked.bound is None:
                continue
            job = self.jobs[tracked.job]
            busy[tracked.node] = busy.get(tracked.node, 0.0) + job.cores
            self.core_minutes += job.cores
            if minute - tracked.bound + 1 >= math.ceil(job.minutes):
                self.completed[job.tier] += 1
                self._delete(name)
        return busy

    def summary(self) -> Dict[str, object]:
        return {"core_hours": round(self.core_minutes / 60.0, 1),
                "lost_core_hours": round(self.lost_core_minutes / 60.0, 1),
                "completed_by_tier": dict(self.completed),
                "evicted_by_tier": {cause: dict(v) for cause, v in self.evicted.items()},
                "evicted_within_a_minute_of_binding": self.evicted_fresh,
                "killed_outside_notice": len(self.killed_outside_notice),
                "killed_outside_notice_first": self.killed_outside_notice[:10],
                "pods_created": self.created, "waiting_at_end": sum(1 for p in self.pods.values() if p.bound is None),
                "pinned_jobs": sum(1 for j in self.jobs if j.node is not None), "pinned_elsewhere": self.pinned_elsewhere}


def node_labels(nodes: Iterable[dict]) -> Dict[str, str]:
    return {(n.get("metadata") or {}).get("name"): ((n.get("metadata") or {}).get("labels") or {}).get(STATE_LABEL, ONLINE)
            for n in nodes}

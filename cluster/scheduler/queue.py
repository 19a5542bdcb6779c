"""The dispatcher's queue: scheduling units, in order, and the units waiting for the cluster to change.

A unit is a pod alone or a gang: the pods of one PodGroup
(``scheduling.x-k8s.io/v1alpha1``, scheduler-plugins' coscheduling CRD, which
Kubeflow's training operator, Spark and others create), placed all or nothing
once ``minMember`` of its pods exist. Units are ordered by priority, then age
(the oldest pod's creation), then arrival; with ``fair``, namespaces take turns
among units of the same priority.

A unit that does not fit is parked with its reason and comes back when the
cluster has changed since (any node, report or pod event: the table's
``version``) and its backoff has passed (1 s, doubling to 10 s, as
kube-scheduler's), and at least once a minute whatever happened. A gang
waiting for members comes back when a member arrives.

``pop`` hands out a unit; for a pod alone it hands out with it the pods right
behind it in the order that have the same template (up to ``batch``): they
are interchangeable, so the placement core places them in one pass (Gödel's
unit of identical pods) and the order is kept.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Set, Tuple

from cluster.scheduler.pods import PodInfo

UnitKey = Tuple[str, ...]  # ("pod", uid) or ("group", namespace, name)
BACKOFF_FIRST, BACKOFF_MAX, FLUSH = 1.0, 10.0, 60.0


class Gang:
    __slots__ = ("namespace", "name", "min_member", "timeout", "first_try")

    def __init__(self, namespace: str, name: str, min_member: int = 1, timeout: Optional[float] = None) -> None:
        self.namespace, self.name = namespace, name
        self.min_member, self.timeout = max(1, min_member), timeout
        self.first_try: Optional[float] = None


class Parked:
    __slots__ = ("version", "since", "retry_after", "reason", "attempts")

    def __init__(self, version: int, since: float, retry_after: float, reason: str, attempts: int) -> None:
        self.version, self.since, self.retry_after, self.reason, self.attempts = \
            version, since, retry_after, reason, attempts


class Unit:
    """What ``pop`` hands out: the pods to place and how many of them must be placed together."""

    __slots__ = ("key", "pods", "need", "gang")

    def __init__(self, key: UnitKey, pods: List[PodInfo], need: int, gang: Optional[Gang]) -> None:
        self.key, self.pods, self.need, self.gang = key, pods, need, gang


class Dispatcher:
    def __init__(self, batch: int = 256, fair: bool = False,
                 backoff: Optional[Tuple[float, float]] = None) -> None:
        """``backoff``: (first, most) seconds a unit that did not fit waits before it is tried again
        (default ``BACKOFF_FIRST``, ``BACKOFF_MAX``); a cluster whose time runs faster than the wall's (a day
        compressed into minutes, ``cluster.day``) scales them with it."""
        self.lock = threading.Condition(threading.RLock())
        first, most = backoff if backoff is not None else (BACKOFF_FIRST, BACKOFF_MAX)
        if not 0 <= first <= most:
            raise ValueError(f"backoff {first}, {most}: need 0 <= first <= most")
        self.backoff = (float(first), float(most))
        self.batch = batch
        self.fair = fair
        self.pending: Dict[str, PodInfo] = {}  # our pods that wait for a node
        self.gangs: Dict[Tuple[str, str], Gang] = {}
        self.members: Dict[Tuple[str, str], Set[str]] = {}  # pending members per gang
        self.bound_members: Dict[Tuple[str, str], Set[str]] = {}  # members with a node
        self._heap: List[tuple] = []
        self._queued: Set[UnitKey] = set()
        self.parked: Dict[UnitKey, Parked] = {}
        self._attempts: Dict[UnitKey, int] = {}
        self._seq = itertools.count()
        self._turns: Deque[str] = deque()  # fair share: namespaces in the order they last had a turn
        self._scanned: Tuple[int, float] = (-1, 0.0)  # (version, when) of the last scan of the parked

    # ---- what the watches say ------------------------------------------------------------------------------
    def add(self, pod: PodInfo) -> None:
        with self.lock:
            self.pending[pod.uid] = pod
            key = self.unit_key(pod)
            if pod.group:
                self.members.setdefault((pod.namespace, pod.group), set()).add(pod.uid)
                self.parked.pop(key, None)  # a new member: the gang may be complete now
            self._push(key, pod)

    def remove(self, uid: str) -> Optional[PodInfo]:
        with self.lock:
            pod = self.pending.pop(uid, None)
            if pod is not None and pod.group:
                self.members.get((pod.namespace, pod.group), set()).discard(uid)
            if pod is not None and not pod.group:
                self.parked.pop(("pod", uid), None)
                self._attempts.pop(("pod", uid), None)
            return pod

    def bound(self, pod: PodInfo) -> None:
        """A member of a gang has a node (counts toward its ``minMember``)."""
        if pod.group:
            with self.lock:
                self.bound_members.setdefault((pod.namespace, pod.group), set()).add(pod.uid)

    def unbound(self, pod: PodInfo) -> None:
        if pod.group:
            with self.lock:
                self.bound_members.get((pod.namespace, pod.group), set()).discard(pod.uid)

    def set_gang(self, gang: Gang) -> None:
        with self.lock:
            key = (gang.namespace, gang.name)
            old = self.gangs.get(key)
            if old is not None:
                gang.first_try = old.first_try
            self.gangs[key] = gang
            unit = ("group", gang.namespace, gang.name)
            self.parked.pop(unit, None)
            members = self.members.get(key)
            if members:
                self._push(unit, self.pending[next(iter(members))])

    def remove_gang(self, namespace: str, name: str) -> None:
        with self.lock:
            self.gangs.pop((namespace, name), None)

    # ---- order ------------------------------------------------------------------------------------------------
    @staticmethod
    def unit_key(pod: PodInfo) -> UnitKey:
        return ("group", pod.namespace, pod.group) if pod.group else ("pod", pod.uid)

    def _push(self, key: UnitKey, pod: PodInfo) -> None:
        if key in self._queued or key in self.parked:
            return
        self._queued.add(key)
        heapq.heappush(self._heap, (-pod.priority, pod.created, next(self._seq), key, pod.namespace))
        self.lock.notify()

    def pop(self, timeout: float = 0.5) -> Optional[Unit]:
        """The next unit, or None after ``timeout`` with nothing to do."""
        with self.lock:
            deadline = time.monotonic() + timeout
            while True:
                self._wake()
                unit = self._next()
                if unit is not None:
                    return unit
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(min(left, 0.5))

    def _next(self) -> Optional[Unit]:
        while self._heap:
            entry = self._take()
            key = entry[3]
            self._queued.discard(key)
            if key[0] == "pod":
                pod = self.pending.get(key[1])
                if pod is None:
                    continue
                run = [pod]
                while self._heap and len(run) < self.batch:
                    top = self._heap[0]
                    other = self.pending.get(top[3][1]) if top[3][0] == "pod" else None
                    if top[3][0] == "pod" and other is None:
                        heapq.heappop(self._heap)
                        self._queued.discard(top[3])
                        continue
                    if other is None or other.template != pod.template:
                        break
                    heapq.heappop(self._heap)
                    self._queued.discard(top[3])
                    run.append(other)
                return Unit(key, run, 1, None)
            gang_key = (key[1], key[2])
            uids = self.members.get(gang_key) or set()
            pods = sorted((self.pending[u] for u in uids if u in self.pending), key=lambda p: (p.created, p.name))
            if not pods:
                continue
            gang = self.gangs.get(gang_key) or Gang(key[1], key[2], 1)
            have = len(self.bound_members.get(gang_key, ()))
            if not self.gangs.get(gang_key):
                self.park(key, 0, f"waiting for PodGroup {key[1]}/{key[2]} (scheduling.x-k8s.io/v1alpha1)",
                          backoff=False)
                continue
            if have + len(pods) < gang.min_member:
                self.park(key, 0, f"waiting for {gang.min_member - have - len(pods)} more pod(s) of gang "
                                  f"{key[1]}/{key[2]} (minMember {gang.min_member})", backoff=False)
                continue
            if gang.first_try is None:
                gang.first_try = time.time()
            return Unit(key, pods, max(0, gang.min_member - have), gang)
        return None

    def _take(self) -> tuple:
        if not self.fair:
            return heapq.heappop(self._heap)
        # fair share: among the units of the top priority, the namespace that waited longest for a turn
        top = self._heap[0][0]
        candidates = [e for e in self._heap if e[0] == top]
        namespaces = {e[4] for e in candidates}
        chosen = None
        for ns in self._turns:
            if ns in namespaces:
                chosen = ns
                break
        if chosen is None:
            chosen = min(candidates)[4]
        entry = min(e for e in candidates if e[4] == chosen)
        self._heap.remove(entry)
        heapq.heapify(self._heap)
        if chosen in self._turns:
            self._turns.remove(chosen)
        self._turns.append(chosen)
        for ns in namespaces:
            if ns not in self._turns:
                self._turns.appendleft(ns)
        return entry

    # ---- parking ------------------------------------------------------------------------------------------------
    def park(self, key: UnitKey, version: int, reason: str, backoff: bool = True) -> None:
        with self.lock:
            attempts = self._attempts.get(key, 0) + 1 if backoff else self._attempts.get(key, 0)
            self._attempts[key] = attempts
            first, most = self.backoff
            delay = min(most, first * 2 ** max(0, attempts - 1)) if backoff else 0.0
            now = time.monotonic()
            # a gang waiting for members wakes on a member's arrival (add), not on the cluster's changes
            self.parked[key] = Parked(version if backoff else -1, now, now + delay, reason, attempts)

    def done(self, key: UnitKey) -> None:
        with self.lock:
            self._attempts.pop(key, None)
            self.parked.pop(key, None)

    def requeue(self, pods: List[PodInfo]) -> None:
        """Pods of a unit that met a conflict (another placement took their room first): back in line."""
        with self.lock:
            for pod in pods:
                if pod.uid in self.pending:
                    self._push(self.unit_key(pod), pod)

    def _wake(self, version: Optional[int] = None) -> None:
        if not self.parked:
            return
        now = time.monotonic()
        current = self.version if version is None else version
        # a scan of thousands of parked pods per pop would cost more than placing them: scan when the
        # cluster changed since the last scan, else twice a second (backoffs expire)
        if current == self._scanned[0] and now - self._scanned[1] < 0.5:
            return
        self._scanned = (current, now)
        for key, parked in list(self.parked.items()):
            if parked.version < 0:
                continue
            if now >= parked.retry_after and (parked.version != current or now - parked.since >= FLUSH):
                del self.parked[key]
                pod = self._representative(key)
                if pod is not None:
                    self._push(key, pod)

    version = 0  # the cluster's version as the service last told it (see ``changed``)

    def changed(self, version: int) -> None:
        with self.lock:
            if version != self.version:
                self.version = version
                self.lock.notify()

    def _representative(self, key: UnitKey) -> Optional[PodInfo]:
        if key[0] == "pod":
            return self.pending.get(key[1])
        uids = self.members.get((key[1], key[2])) or set()
        pods = [self.pending[u] for u in uids if u in self.pending]
        return min(pods, key=lambda p: (p.created, p.name)) if pods else None

    def waiting(self) -> int:
        with self.lock:
            return len(self.pending)

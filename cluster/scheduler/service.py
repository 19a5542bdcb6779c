"""``tidal cluster scheduler``: the process that wires the roles together.

* **Watches** (list, then watch; raw JSON, ``kube.rest``): Nodes, the
  agents' NodeResourceTopology reports, every pod (bound pods are what nodes
  hold), PodGroups and PodDisruptionBudgets. They keep the node table
  (``nodes.NodeTable``) and the dispatcher (``queue.Dispatcher``) true.
* **Scheduler instances** (``core.Placer``; ``shards`` of them, each trying
  its own share of the nodes first, Gödel's node partitions): take a unit
  from the dispatcher, propose a placement, commit it (optimistic: checked
  against the table under its lock) and hand it to the binder. A pod alone
  that does not fit may preempt (``preempt.choose``).
* **Binder** (``binder.Binder``): bindings, evictions, events and statuses.
* **Leader election** (``leader.LeaderElector``): only the replica holding the
  Lease schedules; the others keep their watches warm and take over when it
  expires.

A pod is this scheduler's when its ``spec.schedulerName`` says so. A pod is
counted on its node from the moment it is committed (assumed), through its
binding, until it is deleted or ends: a binding that fails gives its room back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

import numpy as np

from contracts.nrt import GROUP as NRT_GROUP, PLURAL as NRT_PLURAL, VERSION as NRT_VERSION, decode as decode_nrt
from contracts.reports import PlacementError
from kube.rest import ApiError, Rest, list_watch_raw
from cluster.scheduler.binder import Binder
from cluster.scheduler.core import Placer
from cluster.scheduler.leader import LeaderElector
from cluster.scheduler.metrics import SchedulerMetrics
from cluster.scheduler.nodes import NodeTable
from cluster.scheduler.pods import PodInfo
from cluster.scheduler.preempt import Budget, choose
from cluster.scheduler.queue import Dispatcher, Gang, Unit

log = logging.getLogger("tidal.scheduler")
PODGROUPS = "/apis/scheduling.x-k8s.io/v1alpha1/podgroups"
NOMINATION_SECONDS = 30.0


class Scheduler:
    def __init__(self, rest: Rest, name: str = "tidal-scheduler", policy: str = "pack", shards: int = 1,
                 bind_workers: int = 32, stale_after: float = 120.0, batch: int = 256, fair: bool = False,
                 preemption: bool = True, bind_processes: int = 0,
                 backoff: Optional[Tuple[float, float]] = None) -> None:
        if shards < 1:
            raise ValueError("shards must be at least 1")
        self.rest = rest
        self.name = name
        self.metrics = SchedulerMetrics()
        self.table = NodeTable()
        self.dispatcher = Dispatcher(batch=batch, fair=fair, backoff=backoff)
        self.placers = [Placer(self.table, policy, stale_after, (i, shards) if shards > 1 else None)
                        for i in range(shards)]
        self.binder = Binder(rest, name, bind_workers, self._bound, self._bind_failed, self.metrics, bind_processes)
        self.preemption = preemption
        self.lock = threading.RLock()  # pods, where, vectors, inflight
        self.pods: Dict[str, PodInfo] = {}  # every live pod known, by uid
        self.where: Dict[str, int] = {}  # uid -> row it is counted on
        self.vectors: Dict[str, np.ndarray] = {}
        self.inflight: Set[str] = set()  # committed, binding not yet answered
        self.orphans: Dict[str, Set[str]] = {}  # node name -> bound pods whose Node is not known yet
        self.reports: Dict[str, object] = {}
        self.nominations: Dict[str, Tuple[int, float]] = {}  # preemptor uid -> (row, when)
        self.budgets: Dict[Tuple[str, str], Budget] = {}
        self.told: Dict[str, str] = {}  # uid -> the last reason a waiting pod was given
        self.stop = threading.Event()
        self.synced = {k: threading.Event() for k in ("nodes", "reports", "pods", "podgroups", "pdbs")}
        self.running = threading.Event()  # scheduling (leading, or no election)
        self.elector: Optional[LeaderElector] = None
        self.threads: List[threading.Thread] = []

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, leader_elect: bool = False, lease_namespace: str = "kube-system",
              lease_name: str = "tidal-scheduler", identity: Optional[str] = None, sync_timeout: float = 120.0,
              on_lost=None) -> "Scheduler":
        watches = (("nodes", "/api/v1/nodes", self._nodes_listed, self._node_event),
                   ("reports", f"/apis/{NRT_GROUP}/{NRT_VERSION}/{NRT_PLURAL}", self._reports_listed,
                    self._report_event),
                   ("podgroups", PODGROUPS, self._groups_listed, self._group_event),
                   ("pdbs", "/apis/policy/v1/poddisruptionbudgets", self._pdbs_listed, self._pdb_event),
                   ("pods", "/api/v1/pods?fieldSelector=status.phase%21%3DSucceeded%2Cstatus.phase%21%3DFailed",
                    self._pods_listed, self._pod_event))
        for key, path, on_list, on_event in watches:
            self._thread(f"watch-{key}", list_watch_raw, self.rest, path, on_list, on_event, self.stop,
                         f"{key} watch", 300, 5000, self._optional(key))
        deadline = time.monotonic() + sync_timeout
        for key in ("nodes", "pods"):
            if not self.synced[key].wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the {key} list did not arrive within {sync_timeout:g}s")
        for key in ("reports", "podgroups", "pdbs"):  # optional CRDs: a missing one is marked synced
            self.synced[key].wait(max(0.0, min(5.0, deadline - time.monotonic())))
        if leader_elect:
            self.elector = LeaderElector(self.rest, lease_namespace, lease_name, identity)
            self._thread("leader", self.elector.run, self.stop, self._lead, on_lost or self._lost)
        else:
            self._lead()
        self._thread("housekeeping", self._housekeeping)
        return self

    def _optional(self, key: str):
        """A watch of a CRD that is not installed (PodGroups, NRT) is empty, not a failure to sync."""
        def on_error(exc: Exception) -> None:
            if isinstance(exc, ApiError) and exc.status == 404 and key in ("reports", "podgroups"):
                self.synced[key].set()
        return on_error

    def _thread(self, name: str, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _lead(self) -> None:
        self.metrics.leader.set(1)
        self.running.set()
        for i, placer in enumerate(self.placers):
            self._thread(f"schedule-{i}", self._schedule_loop, placer)

    def _lost(self) -> None:
        """Leadership lost: stop placing at once (bindings already sent finish; the new leader sees them)."""
        self.metrics.leader.set(0)
        self.running.clear()

    def close(self) -> None:
        self.running.clear()
        self.stop.set()
        if self.elector is not None:
            self.elector.release()
        self.binder.close()

    # ---- nodes and reports ------------------------------------------------------------------------------------------
    def _nodes_listed(self, items: List[dict]) -> None:
        names = {(n.get("metadata") or {}).get("name") for n in items}
        for name in [n for n in self.table.index if n not in names]:
            self._node_event("DELETED", {"metadata": {"name": name}})
        for node in items:
            self._node_event("ADDED", node)
        self.synced["nodes"].set()

    def _node_event(self, kind: str, node: dict) -> None:
        name = (node.get("metadata") or {}).get("name")
        if kind == "DELETED":
            with self.lock:
                row = self.table.row(name)
                if row is not None:
                    for uid in list(self.table.pods_on[row]):
                        if self.where.get(uid) == row:
                            del self.where[uid]
                            pod = self.pods.get(uid)
                            if pod is not None:
                                self.orphans.setdefault(name, set()).add(uid)
                self.table.remove_node(name)
        else:
            known = self.table.row(name) is not None
            row = self.table.set_node(node)
            if not known:
                with self.lock:
                    report = self.reports.get(name)
                    if report is not None:
                        self.table.set_report(report)
                    for uid in self.orphans.pop(name, ()):
                        pod = self.pods.get(uid)
                        if pod is not None and pod.node == name:
                            self._count(pod, row, None)
        self.metrics.nodes.set(len(self.table))
        self.dispatcher.changed(self.table.version)

    def _reports_listed(self, items: List[dict]) -> None:
        names = set()
        for obj in items:
            self._report_event("ADDED", obj)
            names.add((obj.get("metadata") or {}).get("name"))
        for name in [n for n in list(self.reports) if n not in names]:
            self._report_event("DELETED", {"metadata": {"name": name}})
        self.synced["reports"].set()

    def _report_event(self, kind: str, obj: dict) -> None:
        name = (obj.get("metadata") or {}).get("name")
        if kind == "DELETED":
            self.reports.pop(name, None)
            self.table.remove_report(name)
        else:
            try:
                report = decode_nrt(obj)
            except PlacementError as exc:
                log.warning("ignoring a report: %s", exc)
                return
            self.reports[name] = report
            self.table.set_report(report)
        self.dispatcher.changed(self.table.version)

    # ---- pod groups and budgets ---------------------------------------------------------------------------------------
    def _groups_listed(self, items: List[dict]) -> None:
        for obj in items:
            self._group_event("ADDED", obj)
        self.synced["podgroups"].set()

    def _group_event(self, kind: str, obj: dict) -> None:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        if kind == "DELETED":
            self.dispatcher.remove_gang(namespace, name)
            return
        timeout = spec.get("scheduleTimeoutSeconds")
        try:
            gang = Gang(namespace, name, int(spec.get("minMember") or 1), float(timeout) if timeout else None)
        except (TypeError, ValueError):
            log.warning("PodGroup %s/%s: minMember %r is not a number", namespace, name, spec.get("minMember"))
            return
        self.dispatcher.set_gang(gang)

    def _pdbs_listed(self, items: List[dict]) -> None:
        self.budgets = {}
        for obj in items:
            self._pdb_event("ADDED", obj)
        self.synced["pdbs"].set()

    def _pdb_event(self, kind: str, obj: dict) -> None:
        budget = Budget(obj)
        key = (budget.namespace, budget.name)
        if kind == "DELETED":
            self.budgets.pop(key, None)
        else:
            self.budgets[key] = budget

    # ---- pods ------------------------------------------------------------------------------------------------------
    def _pods_listed(self, items: List[dict]) -> None:
        seen = set()
        for obj in items:
            seen.add((obj.get("metadata") or {}).get("uid"))
            self._pod_event("MODIFIED", obj)
        with self.lock:
            for uid in [u for u in self.pods if u not in seen and u not in self.inflight]:
                self._forget(uid)
        self.synced["pods"].set()

    def _pod_event(self, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        if not uid:
            return
        with self.lock:
            old = self.pods.get(uid)
            if kind == "MODIFIED" and old is not None and old.node and not meta.get("deletionTimestamp") \
                    and (obj.get("spec") or {}).get("nodeName") == old.node \
                    and (meta.get("labels") or {}) == old.labels \
                    and (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                # a bound pod's status changing (its kubelet, KWOK): nothing the scheduler counts changed,
                # and most of a busy cluster's pod events are these
                return
            node = (obj.get("spec") or {}).get("nodeName")
            if kind == "MODIFIED" and old is not None and not old.node and node and uid in self.where \
                    and self.table.row(node) == self.where[uid] and not meta.get("deletionTimestamp") \
                    and (meta.get("labels") or {}) == old.labels:
                # the binding of a pod placed here, coming back: it is counted where it went already
                old.node = node
                self.told.pop(uid, None)
                self.dispatcher.remove(uid)
                self.dispatcher.bound(old)
                self._drop_nomination(uid)
                return
            if kind == "DELETED":
                self._forget(uid)
                self.dispatcher.changed(self.table.version)
                return
            pod = PodInfo.parse(obj)
            if pod.terminal:
                self._forget(uid)
                self.dispatcher.changed(self.table.version)
                return
            self.pods[uid] = pod
            if pod.node:
                self.told.pop(uid, None)
                self.dispatcher.remove(uid)
                self.dispatcher.bound(pod)
                row = self.table.row(pod.node)
                if row is None:
                    self.orphans.setdefault(pod.node, set()).add(uid)
                elif self.where.get(uid) != row:
                    self._uncount(uid)
                    self._count(pod, row, None)
                self._drop_nomination(uid)
                return
            if old is not None and old.node:
                self._uncount(uid)  # bound before, not now: a new pod under the same uid cannot be; be safe
            if pod.scheduler != self.name or uid in self.inflight or pod.deleting:
                return
            if old is None or old.template != pod.template or uid not in self.dispatcher.pending:
                self.dispatcher.remove(uid)
                self.dispatcher.add(pod)

    def _count(self, pod: PodInfo, row: int, zone: Optional[int]) -> None:
        vector = self.vectors.get(pod.uid)
        if vector is None:
            vector = self.vectors[pod.uid] = self.table.vector(pod.requests)
        self.table.add_pod(row, pod, vector, zone)
        self.where[pod.uid] = row

    def _uncount(self, uid: str) -> None:
        row = self.where.pop(uid, None)
        if row is not None:
            self.table.remove_pod(row, uid, self.vectors[uid])

    def _forget(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        self._uncount(uid)
        self.vectors.pop(uid, None)
        self.dispatcher.remove(uid)
        self.told.pop(uid, None)
        self._drop_nomination(uid)
        if pod is not None:
            self.dispatcher.unbound(pod)
            if pod.node:
                self.orphans.get(pod.node, set()).discard(uid)

    # ---- scheduling ---------------------------------------------------------------------------------------------------
    def _schedule_loop(self, placer: Placer) -> None:
        while not self.stop.is_set():
            if not self.running.wait(0.5):
                continue
            unit = self.dispatcher.pop(0.5)
            if unit is None:
                continue
            started = time.perf_counter()
            try:
                self._attempt(unit, placer)
            except Exception:  # noqa: BLE001 - one unit's failure must not stop the scheduler
                log.exception("scheduling %s", unit.key)
                self.dispatcher.park(unit.key, self.table.version, "internal error; retried")
            self.metrics.attempt.observe(time.perf_counter() - started)

    def _vectors_for(self, pods: List[PodInfo]) -> Dict[str, np.ndarray]:
        with self.lock:
            vector = None
            out = {}
            for pod in pods:
                known = self.vectors.get(pod.uid)
                if known is None:
                    if vector is None or pod.template != pods[0].template:
                        vector = self.table.vector(pod.requests)
                    known = self.vectors[pod.uid] = vector
                out[pod.uid] = known
            return out

    def _attempt(self, unit: Unit, placer: Placer) -> None:
        if not self.running.is_set():
            self.dispatcher.requeue(unit.pods)
            return
        for pod in unit.pods:  # a preemptor's own nomination is not in its way
            self._release_nomination(pod.uid)
        vectors = self._vectors_for(unit.pods)
        if unit.gang is None:
            self._place_run(unit, placer, vectors)
        else:
            self._place_gang(unit, placer, vectors)

    def _take(self, placer: Placer, pods: List[PodInfo], vectors) -> Tuple[list, list]:
        with self.lock:
            proposal = self._nominated_first(placer, pods, vectors) or placer.propose(pods)
            taken, conflicts = placer.commit(proposal, vectors)
            for pod, row, _ in taken:
                self.where[pod.uid] = row
                self.inflight.add(pod.uid)
                self.dispatcher.remove(pod.uid)
            return taken, conflicts

    def _nominated_first(self, placer: Placer, pods: List[PodInfo], vectors) -> list:
        """A preemptor goes to the node its victims left, when it fits there now."""
        if len(pods) != 1 or pods[0].uid not in self.nominations:
            return []
        row = self.nominations[pods[0].uid][0]
        copies, zones = placer.copies(pods[0], vectors[pods[0].uid], placer.static_mask(pods[0]))
        if row < len(copies) and copies[row] > 0:
            zone = int(np.argmax(zones[row] > 0)) if zones is not None else None
            return [(pods[0], row, zone)]
        return []

    def _place_run(self, unit: Unit, placer: Placer, vectors) -> None:
        taken, conflicts = self._take(placer, unit.pods, vectors)
        if taken:
            self.binder.submit([(pod, self.table.names[row]) for pod, row, _ in taken])
            for pod, _, _ in taken:
                self.dispatcher.done(("pod", pod.uid))
        if conflicts:
            self.metrics.conflicts.inc(len(conflicts))
            self.dispatcher.requeue([p for p, _, _ in conflicts])
        placed = {p.uid for p, _, _ in taken} | {p.uid for p, _, _ in conflicts}
        left = [p for p in unit.pods if p.uid not in placed]
        if not left:
            return
        self.metrics.unschedulable.labels(left[0].kind).inc(len(left))
        head = left[0]
        reason = placer.why_not(head)
        if self.preemption and self._preempt(head, placer, vectors[head.uid], reason):
            left = left[1:]
        for pod in left:
            self._wait(("pod", pod.uid), pod, reason)

    def _place_gang(self, unit: Unit, placer: Placer, vectors) -> None:
        runs: Dict[tuple, List[PodInfo]] = {}
        for pod in unit.pods:
            runs.setdefault(pod.template, []).append(pod)
        taken_all: list = []
        with self.lock:
            for run in runs.values():
                proposal = placer.propose(run)
                taken, _ = placer.commit(proposal, vectors)
                taken_all += taken
            if len(taken_all) < unit.need:
                placer.release(taken_all, vectors)
                for pod, _, _ in taken_all:
                    self.where.pop(pod.uid, None)
                taken_all = []
            else:
                for pod, row, _ in taken_all:
                    self.where[pod.uid] = row
                    self.inflight.add(pod.uid)
                    self.dispatcher.remove(pod.uid)
        if taken_all:
            self.metrics.gangs.inc()
            self.dispatcher.done(unit.key)
            self.binder.submit([(pod, self.table.names[row]) for pod, row, _ in taken_all])
            return
        gang = unit.gang
        waited = time.time() - (gang.first_try or time.time())
        timeout = f"; waiting {waited:.0f}s, past its scheduleTimeoutSeconds {gang.timeout:g}" \
            if gang.timeout and waited > gang.timeout else ""
        first = unit.pods[0]
        reason = (f"gang {gang.namespace}/{gang.name}: not all of its {unit.need} pod(s) needed (minMember "
                  f"{gang.min_member}) fit at once, so none is bound{timeout}; {placer.why_not(first)}")
        self.metrics.unschedulable.labels("gang").inc()
        self._wait(unit.key, unit.pods, reason)

    def _wait(self, key, pods, reason: str) -> None:
        self.dispatcher.park(key, self.table.version, reason)
        for pod in pods if isinstance(pods, list) else [pods]:
            if self.told.get(pod.uid) != reason:
                self.told[pod.uid] = reason
                self.binder.unschedulable(pod, reason)

    # ---- preemption -----------------------------------------------------------------------------------------------------
    def _preempt(self, pod: PodInfo, placer: Placer, vector: np.ndarray, reason: str) -> bool:
        """Evict the cheapest victims on one node for ``pod`` (see ``preempt``); True when it did."""
        mask = placer.static_mask(pod)
        zone_ok = None
        if pod.numa_bound:  # a zone must hold it already: copies by the zones alone (no node-level resource)
            copies, _ = placer.copies(pod, np.zeros_like(vector), mask)
            zone_ok = copies > 0
        with self.lock:
            found = choose(self.table, pod, vector, mask, self.pods, self.vectors, list(self.budgets.values()),
                           zone_ok)
            if found is None:
                return False
            row, victims = found
            node = self.table.names[row]
        log.info("preempting for %s on %s: %s", pod.key, node, ", ".join(v.key for v in victims))
        evicted = []
        for victim in victims:
            ok, why = self.binder.evict(victim)
            if not ok:
                log.info("preemption for %s: %s was not evicted: %s", pod.key, victim.key, why)
                self._wait(("pod", pod.uid), pod, f"{reason} Preemption on {node} stopped: {victim.key}: {why}")
                return True
            evicted.append(victim)
            self.metrics.victims.labels(victim.kind).inc()
            self.binder.event(victim, "Normal", "Preempted", "Preempting",
                              f"Preempted by {pod.key} on node {node}")
        self.metrics.preemptions.inc()
        with self.lock:
            nominee = self._nominee(pod)
            self.table.add_pod(row, nominee, vector, None)
            self.nominations[pod.uid] = (row, time.monotonic())
        self.binder.nominate(pod, node)
        self._wait(("pod", pod.uid), pod, f"{reason} Preempting {len(evicted)} pod(s) on {node}: "
                                          f"{', '.join(v.key for v in evicted)}.")
        return True

    @staticmethod
    def _nominee(pod: PodInfo) -> PodInfo:
        """What a nomination holds on its node: the preemptor's requests under a uid of its own."""
        held = PodInfo.__new__(PodInfo)
        for slot in PodInfo.__slots__:
            setattr(held, slot, getattr(pod, slot))
        held.uid = f"nominated/{pod.uid}"
        held.numa_bound = False
        return held

    def _release_nomination(self, uid: str) -> None:
        with self.lock:
            held = self.nominations.get(uid)
            if held is not None:
                self.table.remove_pod(held[0], f"nominated/{uid}", self.vectors.get(uid, self.table.vector({})))

    def _drop_nomination(self, uid: str) -> None:
        with self.lock:
            if uid in self.nominations:
                self._release_nomination(uid)
                del self.nominations[uid]

    # ---- the binder's answers ---------------------------------------------------------------------------------------------
    def _bound(self, pod: PodInfo, node: str, when: float) -> None:
        with self.lock:
            self.inflight.discard(pod.uid)
            self._drop_nomination(pod.uid)
        self.metrics.bound.inc()
        if pod.created:
            self.metrics.latency.observe(max(0.0, when - pod.created))

    def _bind_failed(self, pod: PodInfo, node: str, status: int, message: str) -> None:
        self.metrics.bind_errors.labels(str(status)).inc()
        with self.lock:
            self.inflight.discard(pod.uid)
            current = self.pods.get(pod.uid)
            if current is not None and current.node:
                return  # bound after all (a retried request, or someone else): the watch counted it
            self._uncount(pod.uid)
            if status in (404, 409) or current is None:
                log.info("binding %s to %s: %s %s", pod.key, node, status, message)
                return
            log.warning("binding %s to %s failed (%s %s); retrying", pod.key, node, status, message)
            self.dispatcher.add(current)
        self.dispatcher.changed(self.table.version)

    # ---- housekeeping -------------------------------------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        while not self.stop.wait(1.0):
            now = time.monotonic()
            with self.lock:
                for uid, (_, when) in list(self.nominations.items()):
                    if now - when > NOMINATION_SECONDS:
                        self._drop_nomination(uid)
                        pod = self.pods.get(uid)
                        if pod is not None and not pod.node:
                            self.binder.nominate(pod, "")
            self.metrics.pending.set(self.dispatcher.waiting())
            self.dispatcher.changed(self.table.version)

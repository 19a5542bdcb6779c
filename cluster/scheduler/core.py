"""A scheduler instance: filter, score and place a unit of pods over the node table, vectorised.

Filter (one boolean per node, computed once per pod template and kept while
no node's labels, taints, schedulability or lending state change):

1. the node exists and is not cordoned (``spec.unschedulable``, unless the
   pod tolerates ``node.kubernetes.io/unschedulable``);
2. every NoSchedule/NoExecute taint tolerated (evaluated once per distinct
   taint set, not per node);
3. ``nodeSelector`` and the required node affinity (terms ORed, expressions
   ANDed; In, NotIn, Exists, DoesNotExist, Gt, Lt; ``metadata.name`` fields);
4. the lending state: online pods only on ``Online`` nodes, reclaimed pods
   on ``Online`` or lent (``Offline``) nodes, nothing new in a transition;
5. a NUMA-bound pod only on nodes with a fresh report;
6. fit: copies of the pod the node's free resources hold (every requested
   resource: ``alloc - used``), and for a NUMA-bound pod the copies its
   zones hold, each copy inside one zone (cpu, memory and GPUs together).

Score: ``pack`` fills the node with the least free cpu that fits first (best
fit), ``spread`` the freest. A run of identical pods is placed in one pass
(copies per node, then a fill over the ranked nodes), a gang all or nothing:
every pod of every template of the unit placed, at least ``minMember`` with
the members already bound, or nothing is taken.

Placing only proposes; ``commit`` takes what a proposal needs under the
table's lock after checking it against the table as it is then (another
shard, a report or a new pod may have taken it meanwhile): a pod that no
longer fits is a conflict and goes back to the queue. This is the optimistic
concurrency of Gödel's binder, which lets several instances place at once.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from cluster.placement.placer import _fill, _split, _spread
from cluster.scheduler.nodes import NodeTable
from cluster.scheduler.pods import PodInfo, terms_of, tolerations_of
from contracts.states import STATES

ONLINE, TO_OFFLINE, OFFLINE, TO_ONLINE = range(len(STATES))
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
BIG = np.iinfo(np.int64).max // 4

Proposal = List[Tuple[PodInfo, int, Optional[int]]]  # (pod, row, NUMA zone or None)


def tolerates(tolerations: Sequence[dict], taint: Tuple[str, str, str]) -> bool:
    key, value, effect = taint
    for t in tolerations:
        if t.get("effect") and t.get("effect") != effect:
            continue
        operator = t.get("operator") or "Equal"
        if not t.get("key"):
            if operator == "Exists":
                return True
            continue
        if t.get("key") != key:
            continue
        if operator == "Exists" or (t.get("value") or "") == value:
            return True
    return False


class Placer:
    def __init__(self, table: NodeTable, policy: str = "pack", stale_after: float = 120.0,
                 partition: Optional[Tuple[int, int]] = None) -> None:
        if policy not in ("pack", "spread"):
            raise ValueError(f"policy {policy!r}: expected pack or spread")
        self.table = table
        self.policy = policy
        self.stale_after = stale_after
        self.partition = partition  # (this shard, shards): the rows this instance tries first
        self._masks: Dict[tuple, Tuple[int, np.ndarray]] = {}

    # ---- filter ------------------------------------------------------------------------------------------
    def static_mask(self, pod: PodInfo) -> np.ndarray:
        """Filters 1-4 (see the module docstring), kept per template until a node's shape changes."""
        t = self.table
        key = (pod.node_selector, pod.affinity, pod.tolerations, pod.kind)
        known = self._masks.get(key)
        if known is not None and known[0] == t.shape_version and len(known[1]) == len(t.alive):
            return known[1]
        tolerations = tolerations_of(pod.tolerations)
        mask = t.alive.copy()
        if not tolerates(tolerations, (UNSCHEDULABLE_TAINT, "", "NoSchedule")):
            mask &= ~t.unschedulable
        allowed = np.array([all(tolerates(tolerations, taint) for taint in taints) for taints in t.taint_sets])
        mask &= allowed[t.taint_id]
        for label, value in pod.node_selector:
            mask &= t.label_mask(label, [value], "In")
        terms = terms_of(pod.affinity)
        if terms:
            any_term = np.zeros(len(mask), dtype=bool)
            for term in terms:
                expressions = term.get("matchExpressions") or []
                fields = term.get("matchFields") or []
                if not expressions and not fields:
                    continue  # an empty term matches no node (the API's rule)
                this = np.ones(len(mask), dtype=bool)
                for e in expressions:
                    this &= t.label_mask(e.get("key", ""), e.get("values"), e.get("operator", ""))
                for f in fields:
                    this &= t.field_mask(f.get("key", ""), f.get("values"), f.get("operator", ""))
                any_term |= this
            mask &= any_term
        if pod.kind == "reclaimed":
            mask &= (t.state == ONLINE) | (t.state == OFFLINE)
        else:
            mask &= t.state == ONLINE
        if len(self._masks) > 256:
            self._masks.clear()
        self._masks[key] = (t.shape_version, mask)
        return mask

    def copies(self, pod: PodInfo, vector: np.ndarray, mask: np.ndarray,
               now: Optional[float] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Copies of ``pod`` each row holds (0 where filtered out), and per zone for a NUMA-bound pod."""
        t = self.table
        n = t.rows
        cols = np.flatnonzero(vector)
        free = t.alloc[:n, cols] - t.used[:n, cols]
        fit = np.maximum(free, 0) // vector[cols]
        copies = fit.min(axis=1) if len(cols) else np.full(n, BIG)
        zones = None
        if pod.numa_bound:
            cpu, mem, gpus = pod.numa_need()
            zones = np.full(t.zone_cpu[:n].shape, BIG)
            for array, each in ((t.zone_cpu, cpu), (t.zone_mem, mem), (t.zone_gpu, gpus)):
                if each:
                    zones = np.minimum(zones, np.maximum(array[:n], 0) // each)
            if not (cpu or mem or gpus):
                zones = np.where(t.zone_cpu[:n] > 0, 1, 0)
            copies = np.minimum(copies, zones.sum(axis=1))
            fresh = t.reported[:n] & (t.updated[:n] >= (now or time.time()) - self.stale_after)
            copies = np.where(fresh, copies, 0)
        return np.where(mask[:n], copies, 0), zones

    # ---- place ---------------------------------------------------------------------------------------------
    def propose(self, pods: Sequence[PodInfo], now: Optional[float] = None) -> Proposal:
        """Places for as many of ``pods`` (one template) as fit, in order; the rest are left out."""
        if not pods:
            return []
        head = pods[0]
        if head.problem:
            return []
        t = self.table
        vector = t.vector(head.requests)
        mask = self.static_mask(head)
        copies, zones = self.copies(head, vector, mask, now)
        ranked = self._ranked(copies, vector)
        if ranked.size == 0:
            return []
        caps = copies[ranked]
        count = len(pods)
        assign = _fill(caps, count) if self.policy == "pack" else _spread(caps, count)
        used = assign > 0
        rows, counts = ranked[used], assign[used]
        if head.numa_bound:
            per_zone = _split(zones[rows], counts, tight_first=self.policy == "pack")
            slots = [(int(rows[i]), int(z)) for i in range(len(rows)) for z in np.flatnonzero(per_zone[i])
                     for _ in range(int(per_zone[i, z]))]
        else:
            slots = [(int(r), None) for r, c in zip(rows.tolist(), counts.tolist()) for _ in range(c)]
        return [(pod, row, zone) for pod, (row, zone) in zip(pods, slots)]

    def _ranked(self, copies: np.ndarray, vector: np.ndarray) -> np.ndarray:
        feasible = np.flatnonzero(copies)
        if feasible.size == 0:
            return feasible
        if self.partition is not None:
            shard, shards = self.partition
            mine = feasible[feasible % shards == shard]
            if mine.size:
                feasible = mine  # this instance's nodes first; others only when none of its own fits
        t = self.table
        col = t.columns["cpu"] if vector[t.columns["cpu"]] else t.columns["pods"]
        free = t.alloc[feasible, col] - t.used[feasible, col]
        order = np.argsort(free if self.policy == "pack" else -free, kind="stable")
        return feasible[order]

    def commit(self, proposal: Proposal, vectors: Dict[str, np.ndarray]) -> Tuple[Proposal, Proposal]:
        """Take what ``proposal`` needs, pod by pod, checked against the table now: (taken, conflicts)."""
        t = self.table
        taken: Proposal = []
        conflicts: Proposal = []
        with t.lock:
            for pod, row, zone in proposal:
                vector = vectors[pod.uid]
                n = len(vector)
                ok = t.alive[row] and bool(np.all(t.alloc[row, :n] - t.used[row, :n] >= vector))
                if ok and pod.numa_bound:
                    cpu, mem, gpus = pod.numa_need()
                    ok = (zone is not None and t.zone_cpu[row, zone] >= cpu and t.zone_mem[row, zone] >= mem
                          and t.zone_gpu[row, zone] >= gpus)
                if ok:
                    t.add_pod(row, pod, vector, zone)
                    taken.append((pod, row, zone))
                else:
                    conflicts.append((pod, row, zone))
        return taken, conflicts

    def release(self, taken: Proposal, vectors: Dict[str, np.ndarray]) -> None:
        for pod, row, _ in taken:
            self.table.remove_pod(row, pod.uid, vectors[pod.uid])

    # ---- why not -------------------------------------------------------------------------------------------
    def why_not(self, pod: PodInfo, now: Optional[float] = None) -> str:
        """kube-scheduler's kind of message: how many nodes failed each check, first failing check first."""
        t = self.table
        if pod.problem:
            return pod.problem
        total = len(t)
        if not total:
            return "0/0 nodes are available: no nodes"
        n = t.rows
        alive = t.alive[:n]
        reasons: List[Tuple[int, str]] = []
        left = alive.copy()
        tolerations = tolerations_of(pod.tolerations)
        if not tolerates(tolerations, (UNSCHEDULABLE_TAINT, "", "NoSchedule")):
            bad = left & t.unschedulable[:n]
            reasons.append((int(bad.sum()), "node(s) were unschedulable"))
            left &= ~bad
        allowed = np.array([all(tolerates(tolerations, taint) for taint in taints) for taints in t.taint_sets])
        bad = left & ~allowed[t.taint_id[:n]]
        reasons.append((int(bad.sum()), "node(s) had untolerated taints"))
        left &= ~bad
        if pod.node_selector or pod.affinity:
            selected = self.static_mask(pod)[:n] | (t.state[:n] != ONLINE) | ~allowed[t.taint_id[:n]]
            bad = left & ~selected
            reasons.append((int(bad.sum()), "node(s) didn't match Pod's node affinity/selector"))
            left &= ~bad
        states = (t.state[:n] == ONLINE) | ((t.state[:n] == OFFLINE) if pod.kind == "reclaimed" else False)
        bad = left & ~states
        reasons.append((int(bad.sum()), "node(s) were lent or in a lending transition"))
        left &= states
        vector = t.vector(pod.requests)
        if pod.numa_bound:
            fresh = t.reported[:n] & (t.updated[:n] >= (now or time.time()) - self.stale_after)
            bad = left & ~fresh
            reasons.append((int(bad.sum()), f"node(s) had no topology report newer than {self.stale_after:g}s"))
            left &= fresh
        for name, col in t.columns.items():
            if col < len(vector) and vector[col]:
                bad = left & (t.alloc[:n, col] - t.used[:n, col] < vector[col])
                reasons.append((int(bad.sum()), f"Insufficient {name}"))
                left &= ~bad
        if pod.numa_bound:
            copies, _ = self.copies(pod, vector, left, now)
            bad = left & (copies[:n] == 0)
            cpu, mem, gpus = pod.numa_need()
            reasons.append((int(bad.sum()), f"node(s) had no single NUMA zone with {cpu // 1000} cpus and "
                                            f"{mem >> 20} MiB free" + (f" and {gpus} GPUs" if gpus else "")))
        shown = ", ".join(f"{count} {text}" for count, text in reasons if count)
        return f"0/{total} nodes are available: {shown or 'the unit does not fit as a whole'}."

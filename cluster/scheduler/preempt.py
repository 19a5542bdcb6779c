"""Preemption: the smallest set of lower-ranked pods on one node whose eviction lets a pod fit.

Who may be a victim (``PodInfo.rank``): every reclaimed pod ranks below every
online pod whatever their priorities (reclaimed work is revocable by
definition); reclaimed pods rank by tier (low, min, high), then priority;
online pods by priority. A pod may evict only pods of a strictly lower rank.

1. Candidate nodes pass every filter but fit (``Placer.static_mask``) and
   could hold the pod if every lower-ranked pod on them were gone.
2. On each candidate, victims are taken lowest rank first (then the newest)
   until the pod fits; then each victim is given back, highest rank first, if
   the pod still fits without evicting it (kube-scheduler's reprieve).
3. A victim whose eviction a PodDisruptionBudget does not allow now
   (``disruptionsAllowed``, counted over the victims of this one preemption)
   is never chosen: the Eviction API would refuse it anyway.
4. The node whose victims' highest rank is lowest wins; then the fewest
   victims; then the smallest sum of their priorities.

A NUMA-bound pod preempts only where a zone of the node's report already
holds it (which zone a bound pod's cpus are on is the node agent's choice, so
evicting it frees node resources, not a known zone).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from cluster.scheduler.nodes import NodeTable
from cluster.scheduler.pods import PodInfo


class Budget:
    """One PodDisruptionBudget: its namespace, selector and how many pods it lets go now."""

    __slots__ = ("namespace", "name", "match_labels", "expressions", "allowed")

    def __init__(self, pdb: dict) -> None:
        meta = pdb.get("metadata") or {}
        spec = pdb.get("spec") or {}
        selector = spec.get("selector")
        self.namespace = meta.get("namespace", "default")
        self.name = meta.get("name", "")
        self.match_labels = (selector or {}).get("matchLabels") or {}
        self.expressions = (selector or {}).get("matchExpressions") or []
        # a PDB with no selector selects nothing (policy/v1); with an empty one, every pod
        self.allowed = int((pdb.get("status") or {}).get("disruptionsAllowed") or 0) if selector is not None else None

    def covers(self, pod: PodInfo) -> bool:
        if self.allowed is None or pod.namespace != self.namespace:
            return False
        labels = pod.labels
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for e in self.expressions:
            key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
            if op == "In" and labels.get(key) not in values:
                return False
            if op == "NotIn" and key in labels and labels[key] in values:
                return False
            if op == "Exists" and key not in labels:
                return False
            if op == "DoesNotExist" and key in labels:
                return False
        return True


def _fits(free: np.ndarray, need: np.ndarray) -> bool:
    return bool(np.all(free >= need))


def choose(table: NodeTable, preemptor: PodInfo, need: np.ndarray, mask: np.ndarray,
           pods: Dict[str, PodInfo], vectors: Dict[str, np.ndarray], budgets: Sequence[Budget],
           zone_ok: Optional[np.ndarray] = None) -> Optional[Tuple[int, List[PodInfo]]]:
    """(row, victims) for ``preemptor``, or None (see the module docstring). ``zone_ok``: rows where a
    NUMA-bound preemptor's zone already fits."""
    t = table
    n = t.rows
    width = len(need)
    cols = np.flatnonzero(need)
    candidates = mask[:n].copy()
    if zone_ok is not None:
        candidates &= zone_ok[:n]
    # step 1's cheap bound: even with every pod gone the node must hold it
    candidates &= np.all(t.alloc[:n, cols] >= need[cols], axis=1)
    best: Optional[Tuple[tuple, int, List[PodInfo]]] = None
    for row in np.flatnonzero(candidates).tolist():
        lower = [pods[u] for u in t.pods_on[row] if u in pods and pods[u].rank < preemptor.rank
                 and pods[u].uid != preemptor.uid]
        if not lower:
            continue
        free = t.alloc[row, :width] - t.used[row, :width]
        if not _fits(free + sum(_pad(vectors[p.uid], width) for p in lower), need):
            continue
        picked = _victims(free, need, lower, vectors, budgets, width)
        if picked is None:
            continue
        key = (max(p.rank for p in picked), len(picked), sum(p.priority for p in picked))
        if best is None or key < best[0]:
            best = (key, row, picked)
    return None if best is None else (best[1], best[2])


def _pad(vector: np.ndarray, width: int) -> np.ndarray:
    if len(vector) >= width:
        return vector[:width]
    out = np.zeros(width, dtype=np.int64)
    out[:len(vector)] = vector
    return out


def _victims(free: np.ndarray, need: np.ndarray, lower: List[PodInfo], vectors: Dict[str, np.ndarray],
             budgets: Sequence[Budget], width: int) -> Optional[List[PodInfo]]:
    order = sorted(lower, key=lambda p: (p.rank, -p.created))
    spent: Dict[int, int] = {}
    picked: List[PodInfo] = []
    room = free.copy()
    for pod in order:
        if _fits(room, need):
            break
        covering = [i for i, b in enumerate(budgets) if b.covers(pod)]
        if any(spent.get(i, 0) >= budgets[i].allowed for i in covering):
            continue  # its budget allows no more disruptions now
        for i in covering:
            spent[i] = spent.get(i, 0) + 1
        picked.append(pod)
        room = room + _pad(vectors[pod.uid], width)
    if not _fits(room, need):
        return None
    for pod in sorted(picked, key=lambda p: p.rank, reverse=True):  # reprieve, highest rank first
        without = room - _pad(vectors[pod.uid], width)
        if _fits(without, need):
            room = without
            picked.remove(pod)
    return picked


def budgets_of(pdbs: Iterable[dict]) -> List[Budget]:
    return [Budget(p) for p in pdbs]

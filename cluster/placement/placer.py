"""The scheduling core: filter, score and place pod units over a ``ClusterView``.

Filter (per node, vectorised): the node is in a state that takes the pod
(online pods: ``Online``; reclaimed pods: ``Online`` or lent ``Offline``; none
in the two transition states), its report is fresh, and the pod fits:

* ``dedicated`` + ``numa_bound``: cpu, memory and GPUs all inside one NUMA
  zone (the check the kubelet's topology manager makes only after binding,
  which is where "Topology Affinity Error" storms come from);
* ``dedicated`` / ``shared``: the node's free cpu, memory (and GPUs) summed;
* ``reclaimed``: the node's reclaimed capacity.

Score: ``pack`` prefers the node with the least free cpu left (best fit:
fewest nodes used, big free nodes kept for big pods), ``spread`` the most. Inside a node
a NUMA-bound pod takes the tightest zone that fits (pack) or the freest
(spread).

Sampling, as kube-scheduler's ``percentageOfNodesToScore``: feasibility is
computed for every node (it is one vector operation, and it means a pod is
never left pending while some node could take it), but only ``K`` feasible
nodes, taken round-robin from a moving offset, are scored:
K = max(min_sample, N x pct / 100), pct = 50 - N/125 (at least 5) unless set.

A unit of ``count`` identical pods is fitted once per node (how many copies
each node can take) and then spread over the ranked nodes in one pass.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np

from cluster.placement.model import STATES, Placement, PlacementError, PodSpec
from cluster.placement.view import ClusterView

ONLINE, TO_OFFLINE, OFFLINE, TO_ONLINE = (STATES.index(s) for s in STATES)
BIG = np.iinfo(np.int64).max // 4


class Placer:
    def __init__(self, view: ClusterView, policy: str = "pack", sample_percent: Optional[float] = None,
                 min_sample: int = 100, stale_after: Optional[float] = None) -> None:
        if policy not in ("pack", "spread"):
            raise PlacementError(f"policy {policy!r}: expected pack or spread")
        if sample_percent is not None and not 0 < sample_percent <= 100:
            raise PlacementError(f"sample_percent {sample_percent}: expected (0, 100]")
        self.view = view
        self.policy = policy
        self.sample_percent = sample_percent
        self.min_sample = min_sample
        self.stale_after = stale_after
        self.offset = 0

    # ---- fit ----------------------------------------------------------------------------
    def zone_fit(self, spec: PodSpec, rows=None) -> np.ndarray:
        """[node, zone] -> copies of a NUMA-bound pod the zone can take (``rows``: only those nodes)."""
        v = self.view
        sel = slice(None) if rows is None else rows
        fit = v.cpu[sel] // spec.millicpu
        if spec.memory:
            fit = np.minimum(fit, v.mem[sel] // spec.memory)
        if spec.gpus:
            fit = np.minimum(fit, v.gpu[sel] // spec.gpus)
        return fit

    def node_fit(self, spec: PodSpec, now: Optional[float] = None,
                 rows=None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Copies of ``spec`` each node can take (0 where filtered out), and the per-zone fit;
        ``rows``: only those nodes (an index array), in that order."""
        v = self.view
        sel = slice(None) if rows is None else rows
        zones = None
        if spec.kind == "reclaimed":
            fit = v.recl_cpu[sel] // spec.millicpu
            if spec.memory:
                fit = np.minimum(fit, v.recl_mem[sel] // spec.memory)
            state = v.state[sel]
            allowed = (state == ONLINE) | (state == OFFLINE)
        else:
            if spec.numa_bound:
                zones = self.zone_fit(spec, rows)
                fit = zones.sum(axis=1)
            else:
                fit = v.cpu[sel].sum(axis=1) // spec.millicpu
                if spec.memory:
                    fit = np.minimum(fit, v.mem[sel].sum(axis=1) // spec.memory)
                if spec.gpus:
                    fit = np.minimum(fit, v.gpu[sel].sum(axis=1) // spec.gpus)
            allowed = v.state[sel] == ONLINE
        if self.stale_after is not None:
            allowed = allowed & v.fresh(now if now is not None else _now(), self.stale_after)[sel]
        return np.where(allowed, fit, 0), zones

    def _free(self, spec: PodSpec, nodes: np.ndarray) -> np.ndarray:
        """What stays free on each node for this kind of pod (millicores): the best-fit key."""
        v = self.view
        if spec.kind == "reclaimed":
            return v.recl_cpu[nodes]
        return v.cpu[nodes].sum(axis=1)

    def sample_size(self) -> int:
        n = len(self.view)
        pct = self.sample_percent if self.sample_percent is not None else max(5.0, 50.0 - n / 125.0)
        return min(n, max(self.min_sample, int(math.ceil(n * pct / 100.0))))

    # ---- the extender's verbs ----------------------------------------------------------------
    def filter(self, spec: PodSpec, nodes: Optional[np.ndarray] = None) -> np.ndarray:
        """Bool per node (or per given node index): can it take one ``spec``?"""
        fit, _ = self.node_fit(spec)
        return fit > 0 if nodes is None else fit[nodes] > 0

    def scores(self, spec: PodSpec, nodes: np.ndarray, fit: Optional[np.ndarray] = None) -> np.ndarray:
        """0-100 per given node index; 0 where it does not fit (``fit``: node_fit's, if already known)."""
        if fit is None:
            fit, _ = self.node_fit(spec)
        free = self._free(spec, nodes) / max(1, int(self.view.cpu_cap.max()))
        value = (1.0 - free) if self.policy == "pack" else free
        return np.where(fit[nodes] > 0, np.rint(np.clip(value, 0, 1) * 100), 0).astype(np.int64)

    # ---- placing -----------------------------------------------------------------------------
    def place(self, spec: PodSpec, count: int = 1, now: Optional[float] = None) -> Placement:
        """Place up to ``count`` copies of ``spec``; what fits nowhere is left out (``placed < requested``)."""
        if count <= 0:
            raise PlacementError(f"count {count}: must be at least 1")
        fit, zones = self.node_fit(spec, now)
        feasible = np.flatnonzero(fit)
        if feasible.size == 0:
            return Placement(spec, count, [])
        candidates = feasible
        k = self.sample_size()
        if feasible.size > k:
            start = int(np.searchsorted(feasible, self.offset))
            candidates = np.take(feasible, np.arange(start, start + k), mode="wrap")
            self.offset = int(candidates[-1]) + 1
            if fit[candidates].sum() < count:
                candidates = feasible  # the sample cannot hold the unit: rank every feasible node
        free = self._free(spec, candidates)
        order = np.argsort(free if self.policy == "pack" else -free, kind="stable")
        ranked = candidates[order]
        caps = fit[ranked]
        assign = _fill(caps, count) if self.policy == "pack" else _spread(caps, count)
        used = assign > 0
        nodes, counts = ranked[used], assign[used]
        return Placement(spec, count, self._take(spec, nodes, counts, zones))

    def _take(self, spec: PodSpec, nodes: np.ndarray, counts: np.ndarray,
              zones: Optional[np.ndarray]) -> List[Tuple[int, Optional[int], int]]:
        v = self.view
        if spec.kind == "reclaimed":
            v.recl_cpu[nodes] -= counts * spec.millicpu
            v.recl_mem[nodes] -= counts * spec.memory
            return list(zip(nodes.tolist(), [None] * len(nodes), counts.tolist()))
        if spec.numa_bound:
            per_zone = _split(zones[nodes], counts, tight_first=self.policy == "pack")
            v.cpu[nodes] -= per_zone * spec.millicpu
            v.mem[nodes] -= per_zone * spec.memory
            v.gpu[nodes] -= per_zone * spec.gpus
            rows, cols = np.nonzero(per_zone)
            return list(zip(nodes[rows].tolist(), cols.tolist(), per_zone[rows, cols].tolist()))
        for array, each in ((v.cpu, spec.millicpu), (v.mem, spec.memory), (v.gpu, spec.gpus)):
            if each:
                array[nodes] -= _drain(array[nodes], counts * each)
        return list(zip(nodes.tolist(), [None] * len(nodes), counts.tolist()))

    def release(self, placement: Placement) -> None:
        """Give back what a placement took (a pod that ended, or was evicted)."""
        v, spec = self.view, placement.spec
        for node, zone, n in placement.nodes:
            if spec.kind == "reclaimed":
                v.recl_cpu[node] += n * spec.millicpu
                v.recl_mem[node] += n * spec.memory
            elif zone is not None:
                v.cpu[node, zone] += n * spec.millicpu
                v.mem[node, zone] += n * spec.memory
                v.gpu[node, zone] += n * spec.gpus
            else:  # spread back evenly enough: onto the zone with the least free
                z = int(np.argmin(v.cpu[node] + np.where(v.cpu[node] == 0, BIG, 0)))
                v.cpu[node, z] += n * spec.millicpu
                v.mem[node, z] += n * spec.memory
                v.gpu[node, z] += n * spec.gpus


def _now() -> float:
    import time

    return time.time()


def _fill(caps: np.ndarray, count: int) -> np.ndarray:
    """Pack: fill ranked nodes in order until ``count``."""
    cum = np.cumsum(caps)
    assign = caps.copy()
    over = np.searchsorted(cum, count)  # first node where the running total reaches count
    if over < len(caps):
        assign[over] -= cum[over] - count
        assign[over + 1:] = 0
    return assign


def _spread(caps: np.ndarray, count: int) -> np.ndarray:
    """Spread: level the unit over ranked nodes, one round at a time."""
    assign = np.zeros_like(caps)
    left = count
    while left > 0:
        room = caps - assign
        open_nodes = np.flatnonzero(room > 0)
        if open_nodes.size == 0:
            break
        share = max(1, left // open_nodes.size)
        give = np.minimum(room[open_nodes], share)
        cum = np.cumsum(give)
        if cum[-1] > left:  # the last round: only the first nodes get one more
            cut = int(np.searchsorted(cum, left))
            give[cut] -= cum[cut] - left
            give[cut + 1:] = 0
        assign[open_nodes] += give
        left -= int(give.sum())
    return assign


def _split(zone_fit: np.ndarray, counts: np.ndarray, tight_first: bool) -> np.ndarray:
    """Per node, share its pods over its zones: tightest fitting zone first (or freest)."""
    key = np.where(zone_fit > 0, zone_fit, BIG) if tight_first else -zone_fit
    return _take_in_order(zone_fit, counts, np.argsort(key, axis=1, kind="stable"))


def _drain(free: np.ndarray, amount: np.ndarray) -> np.ndarray:
    """Per node, take ``amount`` from its zones, freest first; returns what each zone gives."""
    return _take_in_order(free, amount, np.argsort(-free, axis=1, kind="stable"))


def _take_in_order(caps: np.ndarray, wanted: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Row by row, take ``wanted`` from the columns in ``order``, each up to its cap."""
    ordered = np.take_along_axis(caps, order, axis=1)
    before = np.cumsum(ordered, axis=1) - ordered
    taken = np.clip(wanted[:, None] - before, 0, ordered)
    out = np.zeros_like(caps)
    np.put_along_axis(out, order, taken, axis=1)
    return out

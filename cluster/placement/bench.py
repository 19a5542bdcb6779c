"""``tidal bench placement``: pods/s at cluster scale, beside a per-node loop in the same run.

One process places ``pods`` pods (units of identical pods: NUMA-bound
dedicated, shared, reclaimed; see ``workload``) over ``nodes`` heterogeneous
nodes with ``Placer``; then the loop baseline (``baseline.LoopPlacer``: the
same checks one node and one pod at a time, with the same sampling size)
places the first ``baseline_pods`` pods of the same sequence on a fresh copy
of the same cluster. Its rate per pod does not depend on how many pods it
places, so a prefix keeps the run short. Quality is checked on the result:
nothing over-committed, every NUMA-bound pod inside one zone.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from cluster.placement.baseline import LoopPlacer
from cluster.placement.placer import Placer
from cluster.placement.view import ClusterView
from cluster.placement.workload import make_cluster, make_units


def run(nodes: int = 10000, pods: int = 100000, baseline_pods: int = 2000, policy: str = "pack",
        seed: int = 1) -> Dict[str, Any]:
    reports = make_cluster(nodes, seed=seed)
    units = make_units(pods, seed=seed + 1)
    view = ClusterView(reports)
    placer = Placer(view, policy)
    placed = numa_pods = 0
    start = time.perf_counter()
    placements = []
    for spec, count in units:
        placement = placer.place(spec, count)
        placed += placement.placed
        placements.append(placement)
    elapsed = time.perf_counter() - start
    view.check()
    for placement in placements:
        if placement.spec.numa_bound:
            numa_pods += placement.placed
            assert all(zone is not None for _, zone, _ in placement.nodes)

    loop = LoopPlacer(ClusterView(reports), policy, sample=placer.sample_size())
    done = loop_placed = 0
    start = time.perf_counter()
    for spec, count in units:
        take = min(count, baseline_pods - done)
        loop_placed += loop.place(spec, take)
        done += take
        if done >= baseline_pods:
            break
    loop_elapsed = time.perf_counter() - start
    rate = pods / elapsed
    baseline_rate = done / loop_elapsed
    return {"nodes": nodes, "pods": pods, "pods_per_s": round(rate, 1), "baseline_pods_per_s": round(baseline_rate, 1),
            "ratio": round(rate / baseline_rate, 2), "placed": placed, "numa_bound_placed": numa_pods,
            "units": len(units), "seconds": round(elapsed, 3), "baseline_pods": done,
            "baseline_placed": loop_placed, "baseline_seconds": round(loop_elapsed, 3),
            "sampled_nodes": placer.sample_size(), "policy": policy, "quality": "checked: no over-commit, "
            "every NUMA-bound pod inside one zone"}

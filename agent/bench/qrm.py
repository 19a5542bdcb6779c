"""``tidal bench qrm``: decision latency, checkpoint reload, and fragmentation vs first fit.

1. Decisions: 500 workloads (dedicated, NUMA-bound, shared, reclaimed) are
   admitted one by one on the 256-cpu POWER snapshot (or any --root); every
   ``allocate`` call is timed; p50/p99 reported.
2. Reload: the 500-workload state is checkpointed, then loaded back
   (read, checksum, decode, topology check) ``repeat`` times.
3. Fragmentation: the same random streams (``seeds`` of them) of dedicated
   requests and releases run through Tidal's policy and through a naive first-fit
   allocator (lowest free cpus; NUMA-bound: first node with room); then both
   try to place as many large NUMA-bound whole-core requests (half a node
   each: the latency-critical shape, the kubelet's full-pcpus-only) as they
   can. ``fit_after_churn`` sums them over the streams for the benchmarked
   tree, ``fit_after_churn_x86_smt2`` for a 2x4x8x2 node numbered the x86
   way (siblings n apart), where first fit splits cores.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from typing import Any, Dict, List, Optional

from common.timing import median, percentile
from agent.qrm.model import Allocation, QoS, Rejection, Request, Tier
from agent.qrm.policy import State, _layout, allocate, initial_state
from agent.qrm.state import CheckpointStore
from agent.topology import HostFS, Topology, discover


def first_fit(topo: Topology, state: State, request: Request):
    """The baseline: lowest-numbered free cpus; NUMA-bound: the first node with
    room (for whole-core requests, room in fully free cores)."""
    lay = _layout(topo, state)
    free = sorted(lay.free)
    if request.cpus > len(free) - lay.shared_need:
        return Rejection(request.name, "no room")
    if request.require_whole_cores:
        free = [c for c in free if all(s in lay.free for s in topo.cpus_in_core(topo.cpu(c).core))]
    if request.numa_binding:
        for node in topo.numa_ids():
            here = [c for c in free if topo.cpu(c).numa == node]
            if request.require_whole_cores:
                cores = sorted({topo.cpu(c).core for c in here})
                here = [c for core in cores for c in topo.cpus_in_core(core)]
            if len(here) >= request.cpus:
                return Allocation(request.name, QoS.DEDICATED, request.millicpu, cpus=tuple(here[: request.cpus]),
                                  mems=(node,), numa_binding=True)
        return Rejection(request.name, "no node with room")
    return Allocation(request.name, QoS.DEDICATED, request.millicpu, cpus=tuple(free[: request.cpus]))


def _workloads(n: int, rng: random.Random) -> List[Request]:
    requests = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.15:
            cpus = rng.choice([1, 2])
            requests.append(Request(f"d{i}", QoS.DEDICATED, cpus=cpus, millicpu=cpus * 1000,
                                    numa_binding=rng.random() < 0.5))
        elif kind < 0.8:
            requests.append(Request(f"s{i}", QoS.SHARED, millicpu=rng.choice([100, 250, 500])))
        else:
            requests.append(Request(f"r{i}", QoS.RECLAIMED, millicpu=rng.choice([100, 500, 1000]),
                                    tier=rng.choice(list(Tier))))
    return requests


def _churn(topo: Topology, allocator, steps: int, seed: int, big: int) -> int:
    rng = random.Random(seed)
    state = initial_state(topo)
    total = len(topo.online_cpus())
    live: List[str] = []
    for step in range(steps):
        used = sum(len(a.cpus) for a in state.allocations)
        if live and (used > 0.6 * total or rng.random() < 0.4):
            name = live.pop(rng.randrange(len(live)))
            state = state.without(name)
            continue
        cpus = rng.choice([1, 1, 2, 2, 3, 4, 6, 8])
        request = Request(f"c{step}", QoS.DEDICATED, cpus=cpus, millicpu=cpus * 1000,
                          numa_binding=rng.random() < 0.5)
        decision = allocator(topo, state, request)
        if isinstance(decision, Allocation):
            state = state.with_allocation(decision)
            live.append(decision.name)
    fitted = 0
    while True:
        request = Request(f"big{fitted}", QoS.DEDICATED, cpus=big, millicpu=big * 1000, numa_binding=True,
                          require_whole_cores=True)
        decision = allocator(topo, state, request)
        if not isinstance(decision, Allocation):
            return fitted
        state = state.with_allocation(decision)
        fitted += 1


def _fragmentation(topo: Topology, steps: int, seeds: int) -> Dict[str, Any]:
    """Big requests placed after churn, summed over ``seeds`` streams, for both allocators."""
    node_size = max(len(topo.cpus_in_numa(n)) for n in topo.numa_ids())
    big = max(1, node_size // 2)
    tidal = sum(_churn(topo, allocate, steps, seed, big) for seed in range(1, seeds + 1))
    baseline = sum(_churn(topo, first_fit, steps, seed, big) for seed in range(1, seeds + 1))
    return {"tidal": tidal, "first_fit": baseline, "big_request_cpus": big}


def run(root: Optional[str], workloads: int = 500, repeat: int = 20, churn_steps: int = 3000,
        seeds: int = 5, seed: int = 7) -> Dict[str, Any]:
    if root is None:
        from agent.topology.synthetic import Shape, build_topology

        topo = build_topology(Shape(sockets=2, numa_per_socket=4, cores_per_numa=8, threads_per_core=4))
    else:
        topo = discover(HostFS(root), use_cpuinfo_lib=False)
    rng = random.Random(seed)
    state = initial_state(topo)
    timings: List[float] = []
    admitted = 0
    for request in _workloads(workloads, rng):
        start = time.perf_counter()
        decision = allocate(topo, state, request)
        timings.append((time.perf_counter() - start) * 1000.0)
        if isinstance(decision, Allocation):
            state = state.with_allocation(decision)
            admitted += 1
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "checkpoint.json")
        CheckpointStore(path).save(state, topo)
        size = os.path.getsize(path)
        reloads = []
        for _ in range(repeat):
            start = time.perf_counter()
            result = CheckpointStore(path).load(topo)
            reloads.append((time.perf_counter() - start) * 1000.0)
            assert result.state == state
    fits = _fragmentation(topo, churn_steps, seeds)
    from agent.topology.synthetic import Shape, build_topology

    x86 = build_topology(Shape(sockets=2, numa_per_socket=4, cores_per_numa=8, threads_per_core=2))
    fits_x86 = _fragmentation(x86, churn_steps, seeds)
    return {
        "cpus": len(topo.online_cpus()),
        "workloads": workloads,
        "admitted": admitted,
        "decision_p50_ms": round(median(timings), 4),
        "decision_p99_ms": round(percentile(timings, 99), 4),
        "reload_ms": round(median(reloads), 3),
        "checkpoint_bytes": size,
        "fit_after_churn": fits,
        "fit_after_churn_x86_smt2": fits_x86,
        "churn_steps": churn_steps,
        "churn_seeds": seeds,
    }

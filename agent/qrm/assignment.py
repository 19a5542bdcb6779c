"""THE rule of which cpus, mems and weight a workload of each QoS level runs with.

``assignment(topology, allocation, pools, harvest)`` is pure. Every consumer
calls it and none recomputes it: the desired cgroup tree (Tidal's own tree and
a kubelet pod's cgroups alike), the status and describe output, the
NodeResourceTopology report and the capacity answer.

| level             | cpus                                                     | mems                              | weight (v1 shares)     | idle |
|-------------------|----------------------------------------------------------|-----------------------------------|------------------------|------|
| ``system_cores``  | the reserved pool (the shared pool when there is none)   | every node with memory            | (the kubelet's)        | no   |
| ``dedicated_cores`` | its own cpus                                           | its nodes with ``numa_binding``, else every node | 1024 per cpu | no |
| ``shared_cores``  | the shared pool                                          | every node with memory            | millicpu * 1024 / 1000 | no   |
| ``reclaimed_cores`` | ``reclaimed_cpus``: the reclaim pool, plus the shared pool when it harvests; never the reserved pool, never an SMT sibling of a dedicated cpu (``Pools.held_back``) | every node with memory | millicpu * 1024 / 1000 | yes |

"Every node with memory": ``cpuset.mems`` may only name nodes that have memory
(the kernel's ``N_MEMORY``); a node whose size is unknown counts as having some.
A NUMA-bound workload whose nodes have no memory of their own (cpu nodes beside
memory-only ones, as with CXL, HBM or NVDIMM tiers) gets the memory nodes
nearest to them by the kernel's distances (``nearest_memory``), never every one.

The reserved pool is never lent, not even its idle time at idle priority:
idle priority does not preempt a task while it runs in the kernel, and the
reserved cpus run the agent, the kubelet, the runtime and the node's daemons,
whose reaction is what takes cpus back from reclaimed work
(``tidal bench reserved`` measures both placements side by side). Where no
other cpu is left, reclaimed work has none (``reclaimed_cpus`` is empty) and
is evicted (``services.eviction``, ``qrm.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

from agent.qrm.model import Allocation, Pools, QoS
from agent.topology import Topology

SHARES_PER_CPU = 1024  # the kubelet's unit: shares = millicpu * 1024 / 1000


@dataclass(frozen=True)
class Assignment:
    """What the kernel should give one workload."""

    cpus: Tuple[int, ...]
    mems: Tuple[int, ...]
    cpu_shares: Optional[int]  # None: the level sets no weight of its own (system work shares tidal/system)
    cpu_idle: bool  # SCHED_IDLE for the whole cgroup, where the kernel has cpu.idle


def memory_nodes(topo: Topology) -> Tuple[int, ...]:
    """NUMA nodes a cpuset may name in ``cpuset.mems``."""
    return tuple(n.id for n in topo.numa_nodes if n.memory_bytes != 0)


def nearest_memory(topo: Topology, nodes) -> Tuple[int, ...]:
    """For each of ``nodes``, the memory nodes at the least distance from it (itself when it has
    memory); every memory node where the distances are unknown."""
    every = memory_nodes(topo)
    chosen = set()
    for node in nodes:
        if node in every:
            chosen.add(node)
            continue
        known = [(topo.distance(node, m), m) for m in every]
        known = [(d, m) for d, m in known if d is not None]
        if not known:
            return every
        least = min(d for d, _ in known)
        chosen |= {m for d, m in known if d == least}
    return tuple(sorted(chosen)) or every


def reclaimed_cpus(pools: Pools, harvest: bool) -> Tuple[int, ...]:
    """Where reclaimed work may run: the reclaim pool; when it ``harvest``s (the
    kernel has ``cpu.idle`` and the option is on) also the shared pool, whose
    idle time it takes at idle priority. Never the reserved pool, never
    dedicated cpus unless their owner lends them. With no reclaim pool it waits
    on the shared pool at the minimum quota (its capacity is 0: it is evicted
    after the grace); with no shared pool either, it has no cpu: empty."""
    cpus = set(pools.reclaimed)
    if harvest or not cpus:
        cpus |= set(pools.shared) - set(pools.held_back)  # never an SMT sibling of a dedicated cpu
    return tuple(sorted(cpus))


def system_cpus(pools: Pools) -> Tuple[int, ...]:
    return pools.reserved or pools.shared


def assignment(topo: Topology, alloc: Allocation, pools: Pools, harvest: bool) -> Assignment:
    every = memory_nodes(topo)
    if alloc.qos is QoS.DEDICATED:
        mems = nearest_memory(topo, alloc.mems) if alloc.numa_binding else every
        return Assignment(alloc.cpus, mems, len(alloc.cpus) * SHARES_PER_CPU, False)
    if alloc.qos is QoS.SYSTEM:
        return Assignment(system_cpus(pools), every, None, False)
    shares = max(2, alloc.millicpu * SHARES_PER_CPU // 1000)
    if alloc.qos is QoS.SHARED:
        return Assignment(pools.shared, every, shares, False)
    return Assignment(reclaimed_cpus(pools, harvest), every, shares, True)


def cpu_owners(pools: Pools, allocations: Iterable[Allocation]) -> Dict[int, Tuple[str, Optional[str]]]:
    """Each cpu's pool and the workload that holds it alone, as status shows them: a dedicated
    workload's cpus are its own (lent or not), then held-idle, reserved, shared, and reclaimed for a cpu
    in the reclaim pool only. A cpu in none is missing from the map (the caller calls it unassigned)."""
    owners: Dict[int, Tuple[str, Optional[str]]] = {}
    for cpu in pools.reclaimed:
        owners[cpu] = ("reclaimed", None)
    for name, cpus in (("reserved", pools.reserved), ("shared", pools.shared), ("held-idle", pools.idle)):
        owners.update((cpu, (name, None)) for cpu in cpus)
    for alloc in allocations:
        if alloc.qos is QoS.DEDICATED:
            owners.update((cpu, ("dedicated", alloc.name)) for cpu in alloc.cpus)
    return owners

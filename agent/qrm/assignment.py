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
| ``reclaimed_cores`` | ``reclaimed_cpus``: the reclaim pool, plus the shared and reserved pools when it harvests | every node with memory | millicpu * 1024 / 1000 | yes |

"Every node with memory": ``cpuset.mems`` may only name nodes that have memory
(the kernel's ``N_MEMORY``); a node whose size is unknown counts as having some.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

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


def reclaimed_cpus(pools: Pools, harvest: bool) -> Tuple[int, ...]:
    """Where reclaimed work may run: the reclaim pool; when it ``harvest``s (the
    kernel has ``cpu.idle`` and the option is on) also the shared and reserved
    pools, whose idle time it takes at idle priority (never dedicated cpus,
    unless their owner lends them)."""
    cpus = set(pools.reclaimed)
    if harvest:
        cpus |= set(pools.shared) | set(pools.reserved)
    if not cpus:  # nothing to lend: park on the reserved (or any shared) cpus, throttled to the minimum
        cpus = set(pools.reserved or pools.shared or pools.dedicated[:1])
    return tuple(sorted(cpus))


def system_cpus(pools: Pools) -> Tuple[int, ...]:
    return pools.reserved or pools.shared


def assignment(topo: Topology, alloc: Allocation, pools: Pools, harvest: bool) -> Assignment:
    every = memory_nodes(topo)
    if alloc.qos is QoS.DEDICATED:
        mems = tuple(m for m in alloc.mems if m in every) if alloc.numa_binding else every
        return Assignment(alloc.cpus, mems or every, len(alloc.cpus) * SHARES_PER_CPU, False)
    if alloc.qos is QoS.SYSTEM:
        return Assignment(system_cpus(pools), every, None, False)
    shares = max(2, alloc.millicpu * SHARES_PER_CPU // 1000)
    if alloc.qos is QoS.SHARED:
        return Assignment(pools.shared, every, shares, False)
    return Assignment(reclaimed_cpus(pools, harvest), every, shares, True)

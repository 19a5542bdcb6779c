"""The cgroup tree an allocation state should produce (pure: no I/O).

``desired_tree(topology, state, pools, options)`` returns one ``CgroupSpec``
per cgroup, parents before children, each with its logical knobs (see
``knobs``). The reconciler turns the difference into file writes.

Why the reclaimed cpuset is the reclaim pool *plus* the shared and reserved
pools: where the kernel has ``cpu.idle`` (SCHED_IDLE for a whole cgroup),
offline work on those cpus only gets time that online and system work leave
idle, and is preempted at once when they wake up; so it harvests their idle
time without delaying them (measured by ``tidal bench cpu-isolation``).
Without ``cpu.idle`` it stays on the reclaim pool with the lowest weight.
The quota cap on the reclaimed parent is the reclaimed capacity (headroom):
the kernel enforces what offline agents are told.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from agent.qrm.model import Allocation, Pools, QoS
from agent.qrm.policy import State
from agent.topology import Topology
from agent.topology.parse import format_cpulist

from agent.isolation.cgroups.layout import TIERS, workload_path

CPU_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel's minimum cfs quota: 1% of a cpu per period
TIER_SHARES = {"high": 1024, "min": 256, "low": 64}
SHARES_PER_CPU = 1024


@dataclass(frozen=True)
class CgroupOptions:
    base: str = "tidal"
    harvest_shared: bool = True  # reclaimed work may use the shared pool's idle time (needs cpu.idle)
    reclaimed_cap_millicpu: Optional[int] = None  # None: the reclaimed cpus' count
    reclaimed_memory_max: Optional[int] = None
    reclaimed_memory_high: Optional[int] = None


@dataclass(frozen=True)
class CgroupSpec:
    path: str
    knobs: Dict[str, object] = field(default_factory=dict)
    workload: Optional[str] = None  # the allocation this cgroup belongs to


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


def desired_tree(topo: Topology, state: State, pools: Pools, options: CgroupOptions,
                 features: Dict[str, bool]) -> List[CgroupSpec]:
    base = options.base
    mems_all = format_cpulist(n.id for n in topo.numa_nodes if n.cpus or n.memory_bytes)
    online = format_cpulist(topo.online_cpus())
    system = format_cpulist(pools.reserved or pools.shared)
    shared = format_cpulist(pools.shared)
    dedicated = format_cpulist(pools.dedicated)
    cpu_idle = bool(features.get("cpu.idle"))
    reclaim_set = reclaimed_cpus(pools, cpu_idle and options.harvest_shared)
    reclaim = format_cpulist(reclaim_set)
    if options.reclaimed_cap_millicpu is not None:
        cap_us = max(MIN_QUOTA_US, options.reclaimed_cap_millicpu * CPU_PERIOD_US // 1000)
    elif not pools.reclaimed and not (cpu_idle and options.harvest_shared and pools.shared):
        cap_us = MIN_QUOTA_US
    else:
        cap_us = len(reclaim_set) * CPU_PERIOD_US
    reclaimed_parent: Dict[str, object] = {"cpus": reclaim, "mems": mems_all, "cpu_max": (cap_us, CPU_PERIOD_US)}
    if cpu_idle:
        reclaimed_parent["cpu_idle"] = 1
    else:
        reclaimed_parent["cpu_shares"] = 2
    if features.get("memory"):
        reclaimed_parent["memory_max"] = options.reclaimed_memory_max
        if options.reclaimed_memory_high is not None:
            reclaimed_parent["memory_high"] = options.reclaimed_memory_high

    specs = [
        CgroupSpec(base, {"cpus": online, "mems": mems_all}),
        CgroupSpec(f"{base}/system", {"cpus": system, "mems": mems_all}),
        CgroupSpec(f"{base}/dedicated", {"cpus": dedicated, "mems": mems_all}),
        CgroupSpec(f"{base}/shared", {"cpus": shared, "mems": mems_all}),
        CgroupSpec(f"{base}/reclaimed", reclaimed_parent),
    ]
    specs += [CgroupSpec(f"{base}/reclaimed/{tier}", {"cpus": reclaim, "mems": mems_all,
                                                      "cpu_shares": TIER_SHARES[tier]}) for tier in TIERS]
    for alloc in state.allocations:
        spec = _workload_spec(base, alloc, mems_all, shared, reclaim)
        if spec is not None:
            specs.append(spec)
    return specs


def _workload_spec(base: str, alloc: Allocation, mems_all: str, shared: str, reclaim: str) -> Optional[CgroupSpec]:
    path = workload_path(base, alloc)
    if alloc.qos is QoS.SYSTEM:
        return None  # system workloads share tidal/system
    if alloc.qos is QoS.DEDICATED:
        mems = format_cpulist(alloc.mems) if alloc.numa_binding else mems_all
        return CgroupSpec(path, {"cpus": format_cpulist(alloc.cpus), "mems": mems,
                                 "cpu_shares": len(alloc.cpus) * SHARES_PER_CPU}, alloc.name)
    if alloc.qos is QoS.SHARED:
        # the kubelet's unit: shares = millicpu * 1024 / 1000, which recovery reads back
        return CgroupSpec(path, {"cpus": shared, "mems": mems_all,
                                 "cpu_shares": max(2, alloc.millicpu * SHARES_PER_CPU // 1000)}, alloc.name)
    # reclaimed: weighted by its request like a YARN container (shares, which recovery
    # reads back), capped as a whole by the reclaimed parent's quota, not one by one:
    # offline work may use what the capacity allows, as idle time comes and goes
    return CgroupSpec(path, {"cpus": reclaim, "mems": mems_all,
                             "cpu_shares": max(2, alloc.millicpu * SHARES_PER_CPU // 1000)}, alloc.name)

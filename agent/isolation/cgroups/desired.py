"""The cgroup tree an allocation state should produce (pure: no I/O).

``desired_tree(topology, state, pools, options, features, placements)``
returns one ``CgroupSpec`` per cgroup, parents before children, each with its
logical knobs (see ``knobs``). The reconciler turns the difference into file
writes. What each workload gets comes from ``qrm.assignment`` (the one rule);
this module only decides *where* it is written:

* a local workload: its leaf in Tidal's tree (``layout.workload_path``);
* a workload whose processes live elsewhere (a kubelet pod's cgroup and its
  containers' cgroups: ``placements[name]``, parent first): those cgroups,
  marked ``external``. The reconciler never creates or removes them, writes
  them only once their owner made them, saves their original values before
  its first write and puts them back on revert. Only the cpuset (and
  ``cpu.idle`` for reclaimed work) is Tidal's there; the weight stays the
  kubelet's.

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
from typing import Dict, List, Mapping, Optional, Sequence

from agent.qrm.assignment import SHARES_PER_CPU, Assignment, assignment, memory_nodes, reclaimed_cpus, system_cpus
from agent.qrm.model import KUBERNETES, Pools, QoS
from agent.qrm.policy import State
from agent.topology import Topology
from agent.topology.parse import format_cpulist

from agent.isolation.cgroups.layout import TIERS, workload_path

HELPERS = "helpers"  # <base>/helpers: Tidal's own helper processes

__all__ = ["CgroupOptions", "CgroupSpec", "desired_tree", "partitions", "reclaimed_cpus", "SHARES_PER_CPU"]

CPU_PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel's minimum cfs quota: 1% of a cpu per period
TIER_SHARES = {"high": 1024, "min": 256, "low": 64}
RECLAIMED_HIGH_SHARE = 0.9  # memory.high of the reclaimed parent, as a share of its memory.max
MIB = 1 << 20


MIN_SHARES = 2  # the least cpu weight (cpu.shares; v2 weight 1)


@dataclass(frozen=True)
class CgroupOptions:
    base: str = "tidal"
    harvest_shared: bool = True  # reclaimed work may use the shared pool's idle time (needs cpu.idle)
    reclaimed_cap_millicpu: Optional[int] = None  # None: the reclaimed cpus' count
    reclaimed_memory_max: Optional[int] = None
    reclaimed_memory_high: Optional[int] = None  # None: RECLAIMED_HIGH_SHARE of the max
    # ((cgroup, bytes), ...): memory.low of the measured online cgroups (v2: services.protection); every
    # cgroup above them gets the sum below it (protection_sums), every online cgroup below them SHARE_OF_PARENT
    online_memory_low: tuple = ()
    # reclaimed workloads kept off the shared and reserved pools' idle time (services.kernel_work): they
    # run in the kernel, where idle priority does not preempt them
    confined: frozenset = frozenset()
    dedicated_partition: str = "root"  # "root", "isolated" or "none" (plain cpusets); see partitions()
    # ((device, read_bps or None, write_bps or None), ...): offline work's block io limits (services.io_guard),
    # on the reclaimed tree and each reclaimed pod's cgroup; () lifts any found there (Tidal starts unthrottled)
    offline_io_max: tuple = ()
    # a limited online workload's cpu burst: the share of its quota a period may borrow from what it left
    # unused before (the kernel caps it at the quota: 100); 0 off. Reclaimed work never gets one
    online_cpu_burst_percent: int = 100
    # the host's own cgroups that are neither Tidal's nor the kubelet's (--confine-host-cgroups, a host without
    # systemd), parents first: held on the system cpus, written while they exist, put back as found on revert.
    # On v1 their descendants too (services.enforcement lists them): a parent cannot narrow below a child
    host_cgroups: tuple = ()
    # whether the agent's own process lives in the tree (<base>/system: a host agent outside systemd, or a
    # delegated tree): then the tree weighs as any top cgroup (base_weight)
    agent_in_tree: bool = True


PARTITION_MODES = ("root", "isolated", "none")


def partitions(options: CgroupOptions, features: Mapping[str, bool]) -> Optional[str]:
    """The cpuset partition type dedicated workloads get, or ``None`` for plain cpusets.

    A partition takes its cpus out of the scheduler domain of everyone else (no load balancing of other
    tasks onto them, no migrations of theirs away), which a plain cpuset does not: other cgroups merely
    do not list those cpus. Tidal's dedicated leaves are several levels below the root cgroup, so this
    needs a *remote* partition: ``cpuset.cpus.exclusive`` set along the path (Linux >= 6.7; the kernel
    then offers that file, which is what ``features["partition"]`` says). ``root``: load balancing
    within the workload's own cpus; ``isolated``: none at all (for workloads that pin their threads).
    """
    if options.dedicated_partition not in PARTITION_MODES:
        raise ValueError(f"dedicated partition {options.dedicated_partition!r}: one of {', '.join(PARTITION_MODES)}")
    if options.dedicated_partition == "none" or not features.get("partition"):
        return None
    return options.dedicated_partition


@dataclass(frozen=True)
class CgroupSpec:
    path: str
    knobs: Dict[str, object] = field(default_factory=dict)
    workload: Optional[str] = None  # the allocation this cgroup belongs to
    external: bool = False  # made and removed by someone else (the kubelet): written only while it exists


# memory.low of an online cgroup below a measured one (a workload's leaf, a pod's container): "max" claims
# all it uses, and the kernel shares the parent's protection among the children that claim more than it
# affords in proportion to their use; the parent's figure covers what they use together
SHARE_OF_PARENT = "max"


def protection_sums(leaves) -> Dict[str, int]:
    """``memory.low`` of each cgroup from that of the cgroups holding online processes: its own, and
    for every cgroup above one of them the sum below it (the kernel bounds a cgroup's protection by its
    parent's, shared among the children in proportion to what they claim)."""
    sums: Dict[str, int] = {}
    for path, value in leaves:
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            above = "/".join(parts[:depth])
            sums[above] = sums.get(above, 0) + int(value)
    return sums


def systemd_scope(path: str) -> bool:
    """A container's cgroup that is a systemd unit (the kubelet's systemd driver: ``cri-containerd-<id>.scope``)."""
    return path.rsplit("/", 1)[-1].endswith(".scope")


def placement_only(knobs: Mapping[str, object]) -> Dict[str, object]:
    """What Tidal writes of a container's systemd scope: its cpus and mems, the values the NRI plugin handed
    the runtime (runc gave the unit the same: systemd writes back what Tidal wrote). Its weight, idleness,
    quota and memory protection are the unit's: systemd writes them again whenever the runtime updates the
    unit, and a Tidal value there was undone and repaired in turn (3 times in 180 s of reloads and restarts,
    make test-systemd-kubelet). The pod's slice above carries Tidal's: cgroup v2 holds them for the whole
    subtree (memory.low through the memory_recursiveprot that systemd mounts with)."""
    return {k: v for k, v in knobs.items() if k in ("cpus", "mems")}


def pod_weight(given: Assignment, features: Mapping[str, bool]) -> Dict[str, object]:
    """What the Reconciler writes of a pod's cpu priority: a reclaimed pod's idleness (``cpu.idle``, or the
    lowest weight where the kernel has none); any other pod's weight is the kubelet's. The NRI plugin
    hands the runtime exactly this (``Admission.assignments``), so the two never write different values."""
    if not given.cpu_idle:
        return {}
    return {"cpu_idle": 1} if features.get("cpu.idle") else {"cpu_shares": 2}


def harvests(options: CgroupOptions, features: Mapping[str, bool]) -> bool:
    """Reclaimed work takes the shared pool's idle time (the kernel has ``cpu.idle`` and the option is on)."""
    return bool(features.get("cpu.idle")) and options.harvest_shared


def takes_idle(options: CgroupOptions, features: Mapping[str, bool], name: str) -> bool:
    """Whether reclaimed workload ``name`` takes online's idle cpus: reclaimed work harvests and this one
    is not confined (it runs in the kernel: ``services.kernel_work``). The one rule; every caller asks it."""
    return harvests(options, features) and name not in options.confined


def base_weight(state: State, options: CgroupOptions, placements: Mapping[str, Sequence[str]]) -> Optional[int]:
    """The cpu weight of Tidal's top cgroup, as ``cpu_shares`` (None: the kernel's default).

    ``cpu.idle`` makes the reclaimed tree idle beside its siblings only: at the top of the hierarchy the
    scheduler weighs Tidal's top cgroup against the kubelet's ``kubepods`` (and systemd's slices) by the
    top cgroup's own weight, the default (1024 shares, weight 100) whatever it holds. Where the tree holds
    no online work (the pods are the kubelet's, the agent runs in its pod or its systemd unit), that
    weight is reclaimed work's against the pods: a pod's request could wait half and half with a YARN
    container on a shared cpu (the node tier's day measured online's p99 1.3-1.7x alone). So the top
    cgroup weighs the least (2 shares) while it holds nothing but reclaimed work and Tidal's helpers, and
    the default as soon as a workload of Tidal's own that is not reclaimed lives in it, or the agent."""
    if options.agent_in_tree:
        return None
    for alloc in state.allocations:
        if alloc.qos is not QoS.RECLAIMED and alloc.source != KUBERNETES and alloc.name not in placements:
            return None
    return MIN_SHARES


def desired_tree(topo: Topology, state: State, pools: Pools, options: CgroupOptions,
                 features: Dict[str, bool], placements: Optional[Mapping[str, Sequence[str]]] = None
                 ) -> List[CgroupSpec]:
    base = options.base
    placements = placements or {}
    mems_all = format_cpulist(memory_nodes(topo))
    online = format_cpulist(topo.online_cpus())
    system = format_cpulist(system_cpus(pools))
    shared = format_cpulist(pools.shared)
    dedicated = format_cpulist(pools.dedicated)
    cpu_idle = bool(features.get("cpu.idle"))
    harvest = harvests(options, features)
    reclaim_set = reclaimed_cpus(pools, harvest)
    # no cpu is left for reclaimed work (it is evicted: services.eviction): the tree stays, empty of
    # workloads, parked on the system cpus at the minimum quota (an empty cpuset means "every cpu" on v2)
    reclaim = format_cpulist(reclaim_set or system_cpus(pools))
    if options.reclaimed_cap_millicpu is not None:
        cap_us = max(MIN_QUOTA_US, options.reclaimed_cap_millicpu * CPU_PERIOD_US // 1000)
    elif not pools.reclaimed and not (harvest and pools.shared) or not reclaim_set:
        cap_us = MIN_QUOTA_US
    else:
        cap_us = len(reclaim_set) * CPU_PERIOD_US
    reclaimed_parent: Dict[str, object] = {"cpus": reclaim, "mems": mems_all, "cpu_max": (cap_us, CPU_PERIOD_US)}
    if cpu_idle:
        reclaimed_parent["cpu_idle"] = 1
    else:
        reclaimed_parent["cpu_shares"] = 2
    low = protection_sums(options.online_memory_low) if features.get("memory") else {}
    if features.get("memory"):
        # offline work is throttled and reclaims its own pages (page cache first) at memory.high, before
        # its max; on v1, a soft limit of 0 makes it the first the kernel reclaims from under global
        # pressure (the knob table writes each only where the version has it)
        reclaimed_parent["memory_max"] = options.reclaimed_memory_max
        high = options.reclaimed_memory_high
        if high is None and options.reclaimed_memory_max is not None:
            high = int(options.reclaimed_memory_max * RECLAIMED_HIGH_SHARE) // MIB * MIB
        if high is not None:
            reclaimed_parent["memory_high"] = high
        reclaimed_parent["memory_soft_limit"] = 0
    if features.get("io"):  # v2 with the io controller: offline's block io limits (the knob's whole file)
        reclaimed_parent["io_max"] = tuple(options.offline_io_max)

    def protected(path: str) -> Dict[str, object]:
        return {"memory_low": low[path]} if path in low else {}

    def shielded(alloc, path: str) -> Dict[str, object]:
        """An online workload's cgroup: its measured figure, else its share of its parent's."""
        if path in low or not features.get("memory") or alloc.qos is QoS.RECLAIMED:
            return protected(path)
        return {"memory_low": SHARE_OF_PARENT}

    partition = partitions(options, features)
    # a remote partition's cpus are exclusive all the way down from Tidal's top cgroup: those of the
    # dedicated workloads in Tidal's own tree (a pod's live in the kubelet's cgroups: no partition there)
    partitioned = sorted({c for a in state.allocations if a.qos is QoS.DEDICATED and a.source != KUBERNETES
                          and a.name not in placements for c in a.cpus})
    exclusive: Dict[str, object] = {"cpus_exclusive": format_cpulist(partitioned)} if partition else {}
    specs = [
        CgroupSpec(base, {"cpus": online, "mems": mems_all, "cpu_shares": base_weight(state, options, placements),
                          **exclusive, **protected(base)}),
        CgroupSpec(f"{base}/system", {"cpus": system, "mems": mems_all, **protected(f"{base}/system")}),
        # Tidal's own helpers (push commands, lending hooks): beside system, counted as neither online nor
        # offline (agent.helper_process)
        CgroupSpec(f"{base}/{HELPERS}", {"cpus": system, "mems": mems_all}),
        CgroupSpec(f"{base}/dedicated", {"cpus": dedicated, "mems": mems_all, **exclusive, **protected(f"{base}/dedicated")}),
        CgroupSpec(f"{base}/shared", {"cpus": shared, "mems": mems_all, **protected(f"{base}/shared")}),
        CgroupSpec(f"{base}/reclaimed", reclaimed_parent),
    ]
    specs += [CgroupSpec(f"{base}/reclaimed/{tier}", {"cpus": reclaim, "mems": mems_all,
                                                      "cpu_shares": TIER_SHARES[tier]}) for tier in TIERS]
    external: List[CgroupSpec] = []
    for alloc in state.allocations:
        paths = placements.get(alloc.name)
        if alloc.qos is QoS.SYSTEM and paths is None and alloc.source != KUBERNETES:
            continue  # system workloads in Tidal's tree share tidal/system; a pod's live in its own cgroups
        idle = takes_idle(options, features, alloc.name)
        given = assignment(topo, alloc, pools, idle)
        # (a reclaimed workload with no cpu is evicted before any reconcile: services.eviction.homeless)
        knobs: Dict[str, object] = {"cpus": format_cpulist(given.cpus) or reclaim, "mems": format_cpulist(given.mems)}
        # reclaimed work that may not take the shared pool's idle time (no cpu.idle, or it runs in the kernel:
        # services.kernel_work) and has no lent cpu waits on the shared pool at the minimum quota: its own
        # quota, written every pass (the minimum, or none), so leaving that state lifts it
        parked = alloc.qos is QoS.RECLAIMED and not pools.reclaimed and not idle
        if paths is not None or alloc.source == KUBERNETES:
            # where the kubelet (or runtime) put its processes; nothing until it made them
            if given.cpu_idle:
                # the kubelet gives reclaimed pods no common parent to cap as Tidal's tree has: each pod
                # is capped at the node's whole reclaimed capacity, at the lowest priority
                knobs["cpu_max"] = (MIN_QUOTA_US, CPU_PERIOD_US) if parked else reclaimed_parent["cpu_max"]
                knobs.update(pod_weight(given, features))
            pod_own: Dict[str, object] = {}
            if alloc.qos is QoS.RECLAIMED and features.get("memory"):
                # the pod's own cgroup bounds its containers: the first reclaimed from under global pressure
                # (v1), throttled at the reclaimed tree's memory.high (v2); its memory.max stays the kubelet's
                pod_own = {"memory_soft_limit": 0, **({"memory_high": reclaimed_parent["memory_high"]}
                                                         if "memory_high" in reclaimed_parent else {})}
            if alloc.qos is QoS.RECLAIMED and "io_max" in reclaimed_parent:
                pod_own["io_max"] = reclaimed_parent["io_max"]  # the same block io limits as the tree
            # a pod's own cgroup is measured (services.protection); its containers below take their share
            external += [CgroupSpec(path, {**knobs, **(pod_own if i == 0 else {}),
                                           **(protected(path) if i == 0 else shielded(alloc, path))}
                                    if i == 0 or not systemd_scope(path) else placement_only(knobs),
                                    alloc.name, external=True) for i, path in enumerate(paths or ())]
            continue
        if given.cpu_shares is not None:
            knobs["cpu_shares"] = given.cpu_shares
        if alloc.qos is QoS.SHARED and alloc.limit_millicpu is not None:
            quota = max(MIN_QUOTA_US, alloc.limit_millicpu * CPU_PERIOD_US // 1000)
            knobs["cpu_max"] = (quota, CPU_PERIOD_US)
            if features.get("cpu.burst"):
                knobs["cpu_burst"] = quota * max(0, min(100, options.online_cpu_burst_percent)) // 100
        if alloc.qos is QoS.RECLAIMED:
            knobs["cpu_max"] = (MIN_QUOTA_US if parked else None, CPU_PERIOD_US)
        if partition and alloc.qos is QoS.DEDICATED and given.cpus:
            knobs["cpus_exclusive"] = knobs["cpus"]
            knobs["partition"] = partition
        path = workload_path(base, alloc)
        specs.append(CgroupSpec(path, {**knobs, **shielded(alloc, path)}, alloc.name))
    # the host's own work outside Tidal and the kubelet, on the system cpus (parents first: widened top-down,
    # narrowed bottom-up by the Reconciler like every cpuset)
    external += [CgroupSpec(path, {"cpus": system}, external=True) for path in options.host_cgroups]
    # the cgroups above protected pods (the kubelet's kubepods and QoS-class cgroups): their memory.low is
    # the sum below, else the pods' would be bounded by nothing above them; written, like the pods', only
    # while they exist, and put back as found on revert
    known = {spec.path for spec in specs + external}
    above = sorted({path for spec in external for path in low if spec.path.startswith(path + "/")} - known,
                   key=lambda p: p.count("/"))
    return specs + [CgroupSpec(path, {"memory_low": low[path]}, external=True) for path in above] + external

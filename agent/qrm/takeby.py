"""Topology-aware choice of cpus for exclusive (dedicated) allocations.

In the spirit of the kubelet's ``takeByTopology``, with two changes: a
request that fits one NUMA node or one L3 group stays inside it (the kubelet
only reasons in sockets and cores), and the remainder goes to the *most
allocated* container that fits (best fit), which keeps whole nodes and whole
L3 groups free for the large requests that need them.

Pure functions over a ``Topology`` and a set of free cpus; deterministic:
every choice is ordered by explicit keys ending in the lowest id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

from agent.topology import Topology


@dataclass(frozen=True)
class _Index:
    core_cpus: Dict[int, Tuple[int, ...]]
    core_numa: Dict[int, Optional[int]]
    core_l3: Dict[int, Optional[int]]
    levels: Tuple[Tuple[str, Dict[int, Tuple[int, ...]]], ...]  # (name, {group: cores}), finest first
    numa_cores: Dict[int, Tuple[int, ...]]


def index(topo: Topology) -> _Index:
    """Per-topology lookup tables, built once and kept on the (immutable) topology."""
    cached = getattr(topo, "_qrm_index", None)
    if cached is not None:
        return cached
    core_cpus = {c: topo.cpus_in_core(c) for c in topo.core_ids()}
    first = {c: topo.cpu(cpus[0]) for c, cpus in core_cpus.items()}
    groups: Dict[str, Dict[int, List[int]]] = {"l3": {}, "numa": {}, "socket": {}}
    for core, cpu in first.items():
        for kind in groups:
            value = getattr(cpu, kind)
            if value is not None:
                groups[kind].setdefault(value, []).append(core)
    levels = []
    for kind, members in groups.items():
        if members:
            average = sum(len(v) for v in members.values()) / len(members)
            levels.append((average, kind, {g: tuple(v) for g, v in members.items()}))
    levels.sort(key=lambda item: (item[0], ("l3", "numa", "socket").index(item[1])))
    result = _Index(
        core_cpus=core_cpus,
        core_numa={c: cpu.numa for c, cpu in first.items()},
        core_l3={c: cpu.l3 for c, cpu in first.items()},
        levels=tuple((kind, members) for _, kind, members in levels),
        numa_cores={g: tuple(v) for g, v in groups["numa"].items()},
    )
    object.__setattr__(topo, "_qrm_index", result)
    return result


def capacity(idx: _Index, cores: Iterable[int], free: Set[int], whole_cores: bool) -> int:
    """Cpus a request can get from ``cores``: free threads, or only those of fully free cores."""
    total = 0
    for core in cores:
        cpus = idx.core_cpus[core]
        n = sum(1 for c in cpus if c in free)
        if whole_cores:
            total += n if n == len(cpus) else 0
        else:
            total += n
    return total


def _fully_free(idx: _Index, cores: Iterable[int], free: Set[int]) -> bool:
    return all(c in free for core in cores for c in idx.core_cpus[core])


def _best_home(idx: _Index, scope: Set[int], free: Set[int], need: int, whole_cores: bool,
               preferred: Set[Optional[int]]) -> Optional[Tuple[int, ...]]:
    """The finest-level container inside ``scope`` that can hold ``need`` cpus:
    in a preferred NUMA node if one can, then best fit (least capacity), then
    lowest id."""
    for _kind, members in idx.levels:
        candidates = []
        for group, cores in members.items():
            if not scope.issuperset(cores):
                continue
            cap = capacity(idx, cores, free, whole_cores)
            if cap >= need:
                candidates.append((idx.core_numa[cores[0]] not in preferred, cap, group, cores))
        if candidates:
            return min(candidates)[3]
    return None


def take_cpus(topo: Topology, free: Iterable[int], count: int, *, whole_cores: bool,
              prefer_numa: Sequence[int] = ()) -> Optional[Tuple[int, ...]]:
    """Choose ``count`` cpus out of ``free``; ``None`` if they cannot be had.

    1. If one container (L3 group, NUMA node or socket, finest level first)
       can hold the whole request, work inside the best one: in a preferred
       NUMA node (``prefer_numa``: a GPU's or NIC's) if possible, then the
       best fit, i.e. the least capacity that suffices (only fully free
       cores count when ``whole_cores``), then the lowest id.
       Otherwise work on the whole machine.
    2. Whole containers, coarsest level first: while the remainder is at
       least the size of a fully free container in scope, take one, preferring
       the NUMA nodes already taken (or ``prefer_numa``), then the most
       allocated NUMA node, then the lowest id.
    3. A home for the remainder: the best fitting container in scope as in 1;
       none fits: the scope itself, filled from the NUMA nodes with the most
       free cpus first (so the request spans as few nodes as possible).
    4. In the home, take fully free cores, those in the most allocated L3
       group first, then by core id.
    5. Unless ``whole_cores``, finish with single threads, from the most
       allocated partly free cores first (they are of no use to whole-core
       requests anyway), then by core id.
    """
    idx = index(topo)
    free_set: Set[int] = set(free)
    if count <= 0:
        return ()
    all_cores = set(idx.core_cpus)
    if capacity(idx, all_cores, free_set, whole_cores) < count:
        return None
    chosen: List[int] = []
    preferred: Set[Optional[int]] = set(prefer_numa)

    def take(cpus: Iterable[int]) -> None:
        for cpu in cpus:
            free_set.discard(cpu)
            chosen.append(cpu)
            preferred.add(idx.core_numa[topo.cpu(cpu).core])

    # 1. one container for everything, if one can hold it
    home = _best_home(idx, all_cores, free_set, count, whole_cores, preferred)
    scope = set(home) if home is not None else all_cores

    # 2. whole containers, coarsest level first
    remaining = count
    numa_free = {n: sum(1 for core in cores for c in idx.core_cpus[core] if c in free_set)
                 for n, cores in idx.numa_cores.items()}
    for _kind, members in reversed(idx.levels):
        while remaining:
            fits = [(idx.core_numa[cores[0]] not in preferred, numa_free.get(idx.core_numa[cores[0]], 0), g, cores)
                    for g, cores in members.items()
                    if scope.issuperset(cores) and _fully_free(idx, cores, free_set)
                    and sum(len(idx.core_cpus[c]) for c in cores) <= remaining]
            if not fits:
                break
            cores = min(fits)[3]
            take(c for core in cores for c in idx.core_cpus[core])
            remaining = count - len(chosen)
    if remaining == 0:
        return tuple(sorted(chosen))

    # 3. a home for the remainder
    home = _best_home(idx, scope, free_set, remaining, whole_cores, preferred)
    numa_rank: Dict[Optional[int], int] = {}
    if home is None:
        numa_free = {n: sum(1 for core in cores for c in idx.core_cpus[core] if c in free_set)
                     for n, cores in idx.numa_cores.items()}
        order = sorted({idx.core_numa[core] for core in scope}, key=lambda n: (
            n not in preferred, -numa_free.get(n, 0), -1 if n is None else n))
        numa_rank = {n: i for i, n in enumerate(order)}
        home = tuple(sorted(scope))

    # 4. whole cores in the home, most allocated L3 first
    l3_free: Dict[Optional[int], int] = {}
    for core in home:
        l3_free[idx.core_l3[core]] = l3_free.get(idx.core_l3[core], 0) + sum(
            1 for c in idx.core_cpus[core] if c in free_set)
    whole = [core for core in home if _fully_free(idx, (core,), free_set)]
    whole.sort(key=lambda core: (numa_rank.get(idx.core_numa[core], 0), l3_free[idx.core_l3[core]], core))
    for core in whole:
        size = len(idx.core_cpus[core])
        if size <= remaining:
            take(idx.core_cpus[core])
            remaining -= size
        if remaining == 0:
            return tuple(sorted(chosen))
    if whole_cores:
        return None
    # 5. single threads, most allocated cores first
    partial = [core for core in home if any(c in free_set for c in idx.core_cpus[core])]
    partial.sort(key=lambda core: (numa_rank.get(idx.core_numa[core], 0),
                                   sum(1 for c in idx.core_cpus[core] if c in free_set), core))
    for core in partial:
        for cpu in idx.core_cpus[core]:
            if cpu in free_set and remaining:
                take((cpu,))
                remaining -= 1
        if remaining == 0:
            return tuple(sorted(chosen))
    return None


def cores_of(topo: Topology, cpus: Iterable[int]) -> Set[int]:
    return {topo.cpu(c).core for c in cpus}


def is_whole_cores(topo: Topology, cpus: FrozenSet[int]) -> bool:
    idx = index(topo)
    return all(set(idx.core_cpus[core]) <= cpus for core in cores_of(topo, cpus))

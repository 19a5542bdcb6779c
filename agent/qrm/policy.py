"""The QoS policy: ``allocate(topology, state, request) -> Allocation | Rejection``.

Pure: no I/O, no clock, no globals; the same inputs give the same answer.

Pools (derived from the state, never stored; see ``pools``):

* reserved: ``state.reserved`` (system_cores; default the first physical core).
* dedicated: the union of dedicated allocations' exclusive cpus.
* held: cpus of NUMA nodes taken whole (``numa_exclusive`` or a binding
  larger than one node) that their owner does not use: nobody else's
  dedicated or shared work goes there; they may be lent to reclaimed work.
* free = online - reserved - dedicated - held. The shared pool is ``free``
  minus what is lent to reclaim, and never smaller than the shared requests
  need (sum of millicpu, rounded up to whole cpus).
* reclaimed: lent cpus, up to ``state.reclaim_cpus`` (``None``: as many as
  possible). Reclaimed requests are admitted against ``state.reclaim_millicpu``
  (the headroom the agent measures, which may include the shared pool's idle
  time where the kernel lets offline work take it at idle priority), else
  against the reclaim pool's cpus. Lent first: held cpus and dedicated cpus whose owner allows it
  (``reclaim_allowed``); then whole cores carved from the shared pool's
  far end (highest NUMA node, highest core), so the carve grows and shrinks
  at one edge and the rest of the shared pool stays put.
* held back (``Pools.held_back``): on SMT machines, the sibling threads of a
  dedicated workload's cpus (one that does not lend them itself). A sibling
  shares its core's pipeline, L1/L2 and their bandwidth with the dedicated
  thread: reclaimed work never runs there, neither lent, carved nor
  harvested at idle priority (online work of the shared pool may: it is the
  node's own). ``state.reclaim_siblings`` (``--reclaimed-on-smt-siblings``)
  gives them to reclaimed work where harvest matters more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

from agent.errors import AdmissionError
from agent.qrm.model import Allocation, Decision, Pools, QoS, Rejection, Request
from agent.qrm.takeby import capacity, index, take_cpus
from agent.topology import Topology
from agent.topology.parse import format_cpulist

POLICY = "tidal-qrm/v1"


@dataclass(frozen=True)
class _Totals:
    """Aggregates of a state's allocations, kept so a decision costs O(cpus),
    not O(workloads): derived incrementally by ``with_allocation``/``without``."""

    by_name: Dict[str, Allocation]
    dedicated: FrozenSet[int]
    held_nodes: Dict[int, int]  # node -> how many allocations hold it
    shared_millicpu: int
    reclaimed_millicpu: int
    lendable: FrozenSet[int]

    @staticmethod
    def of(allocations: Iterable[Allocation]) -> "_Totals":
        totals = _Totals({}, frozenset(), {}, 0, 0, frozenset())
        for alloc in allocations:
            totals = totals.plus(alloc)
        return totals

    def plus(self, a: Allocation) -> "_Totals":
        held = dict(self.held_nodes)
        for node in a.nodes:
            held[node] = held.get(node, 0) + 1
        return _Totals(
            by_name={**self.by_name, a.name: a},
            dedicated=self.dedicated | frozenset(a.cpus) if a.qos is QoS.DEDICATED else self.dedicated,
            held_nodes=held,
            shared_millicpu=self.shared_millicpu + (a.millicpu if a.qos is QoS.SHARED else 0),
            reclaimed_millicpu=self.reclaimed_millicpu + (a.millicpu if a.qos is QoS.RECLAIMED else 0),
            lendable=self.lendable | frozenset(a.cpus) if a.reclaim_allowed else self.lendable,
        )

    def minus(self, a: Allocation) -> "_Totals":
        held = dict(self.held_nodes)
        for node in a.nodes:
            held[node] -= 1
            if not held[node]:
                del held[node]
        by_name = dict(self.by_name)
        del by_name[a.name]
        return _Totals(
            by_name=by_name,
            dedicated=self.dedicated - frozenset(a.cpus) if a.qos is QoS.DEDICATED else self.dedicated,
            held_nodes=held,
            shared_millicpu=self.shared_millicpu - (a.millicpu if a.qos is QoS.SHARED else 0),
            reclaimed_millicpu=self.reclaimed_millicpu - (a.millicpu if a.qos is QoS.RECLAIMED else 0),
            lendable=self.lendable - frozenset(a.cpus) if a.reclaim_allowed else self.lendable,
        )


@dataclass(frozen=True)
class State:
    """What the node has handed out. Allocations keep admission order."""

    reserved: Tuple[int, ...]
    allocations: Tuple[Allocation, ...] = ()
    reclaim_cpus: Optional[int] = None
    reclaim_millicpu: Optional[int] = None  # reclaimed capacity (headroom); None: the reclaim pool's cpus
    reclaim_siblings: bool = False  # reclaimed work may run on a dedicated cpu's SMT siblings (an agent option)

    @property
    def totals(self) -> _Totals:
        cached = self.__dict__.get("_totals")
        if cached is None:
            cached = _Totals.of(self.allocations)
            object.__setattr__(self, "_totals", cached)
        return cached

    def _derived(self, allocations: Tuple[Allocation, ...], totals: _Totals) -> "State":
        new = replace(self, allocations=allocations)
        object.__setattr__(new, "_totals", totals)
        return new

    def get(self, name: str) -> Optional[Allocation]:
        return self.totals.by_name.get(name)

    def names(self) -> List[str]:
        return [a.name for a in self.allocations]

    def with_allocation(self, alloc: Allocation) -> "State":
        return self._derived(self.allocations + (alloc,), self.totals.plus(alloc))

    def without(self, name: str) -> "State":
        alloc = self.get(name)
        if alloc is None:
            return self
        return self._derived(tuple(a for a in self.allocations if a.name != name), self.totals.minus(alloc))

    def with_reclaim_cpus(self, cpus: Optional[int]) -> "State":
        new = replace(self, reclaim_cpus=cpus)
        object.__setattr__(new, "_totals", self.totals)
        return new

    def with_reclaim_capacity(self, millicpu: Optional[int]) -> "State":
        new = replace(self, reclaim_millicpu=millicpu)
        object.__setattr__(new, "_totals", self.totals)
        return new


def default_reserved(topo: Topology) -> Tuple[int, ...]:
    """The first physical core of the node, all its threads; on a node of one
    core, its first thread; on a node of one cpu, nothing (system work then
    shares the shared pool)."""
    online = topo.online_cpus()
    first_core = topo.cpus_in_core(topo.core_ids()[0])
    if len(first_core) < len(online):
        return first_core
    return first_core[:1] if len(online) > 1 else ()


def initial_state(topo: Topology, reserved: Optional[Iterable[int]] = None,
                  reclaim_cpus: Optional[int] = None) -> State:
    """An empty state; ``reserved`` is checked against the online cpus."""
    chosen = tuple(sorted(set(reserved))) if reserved is not None else default_reserved(topo)
    online = set(topo.online_cpus())
    missing = [c for c in chosen if c not in online]
    if missing:
        raise AdmissionError(f"reserved cpus {format_cpulist(missing)} are not online cpus of this node "
                             f"(online: {format_cpulist(online)})")
    if len(chosen) >= len(online):
        raise AdmissionError(f"reserved cpus {format_cpulist(chosen)} leave no cpu for workloads")
    if reclaim_cpus is not None and reclaim_cpus < 0:
        raise AdmissionError(f"reclaim cpus must be >= 0, got {reclaim_cpus}")
    return State(reserved=chosen, reclaim_cpus=reclaim_cpus)


@dataclass(frozen=True)
class _Layout:
    reserved: Set[int]
    dedicated: Set[int]
    held: Set[int]
    held_nodes: Set[int]
    free: Set[int]
    shared_need: int


def _layout(topo: Topology, state: State) -> _Layout:
    online = set(topo.online_cpus())
    reserved = set(state.reserved) & online
    totals = state.totals
    dedicated = set(totals.dedicated)
    held_nodes = set(totals.held_nodes)
    held = {c for n in held_nodes for c in topo.cpus_in_numa(n)} - dedicated - reserved
    free = online - reserved - dedicated - held
    return _Layout(reserved, dedicated, held, held_nodes, free, -(-totals.shared_millicpu // 1000))


def _carve_order(topo: Topology, cpus: Set[int]) -> List[int]:
    """Cpus of ``cpus`` in the order the reclaim carve takes them: whole cores
    from the far end (highest NUMA node, then highest core id)."""
    idx = index(topo)
    cores = sorted({topo.cpu(c).core for c in cpus},
                   key=lambda core: (-1 if idx.core_numa[core] is None else idx.core_numa[core], core), reverse=True)
    return [c for core in cores for c in idx.core_cpus[core] if c in cpus]


def smt_siblings_held_back(topo: Topology, state: State) -> Dict[int, str]:
    """Each cpu reclaimed work may not use because it is an SMT sibling of a dedicated workload's cpu
    (the workload's name): none where ``state.reclaim_siblings`` allows them, or on a node without SMT.
    A workload that lends its own cpus (``reclaim_allowed``) has said reclaimed work may share its
    cores; its siblings are not held back for it. Reserved cpus are never reclaimed's anyway."""
    if state.reclaim_siblings:
        return {}
    idx = index(topo)
    reserved = set(state.reserved)
    out: Dict[int, str] = {}
    for alloc in state.allocations:
        if alloc.qos is not QoS.DEDICATED or alloc.reclaim_allowed:
            continue
        own = set(alloc.cpus)
        for cpu in alloc.cpus:
            for sibling in idx.core_cpus[topo.cpu(cpu).core]:
                if sibling not in own and sibling not in reserved:
                    out.setdefault(sibling, alloc.name)
    return out


def pools(topo: Topology, state: State) -> Pools:
    lay = _layout(topo, state)
    held_back = set(smt_siblings_held_back(topo, state))
    lendable = (set(lay.held) | state.totals.lendable) - held_back
    target = state.reclaim_cpus
    # the shared pool may keep held-back cpus (online work may run beside online work): they count towards
    # what shared requests need, and are never carved
    carvable = max(0, min(len(lay.free - held_back), len(lay.free) - lay.shared_need))
    lend_order = sorted(lendable)
    if target is None:
        lent = set(lend_order)
        carve = carvable
    else:
        lent = set(lend_order[:target])
        carve = min(carvable, max(0, target - len(lent)))
    order = _carve_order(topo, lay.free - held_back)
    # carve whole cores only: stop before a core that would be split
    carved: List[int] = []
    idx = index(topo)
    position = 0
    while position < len(order) and len(carved) < carve:
        core = topo.cpu(order[position]).core
        members = [c for c in idx.core_cpus[core] if c in lay.free and c not in held_back]
        if len(carved) + len(members) > carve:
            break
        carved.extend(members)
        position += len(members)
    reclaimed = lent | set(carved)
    shared = lay.free - set(carved)
    return Pools(
        reserved=tuple(sorted(lay.reserved)), shared=tuple(sorted(shared)), reclaimed=tuple(sorted(reclaimed)),
        dedicated=tuple(sorted(lay.dedicated)), idle=tuple(sorted(lay.held - lent)),
        lendable=tuple(sorted(lendable)),
        held_back=tuple(sorted(held_back & (lay.free | lay.held | state.totals.lendable))))


def reclaimed_capacity(topo: Topology, state: State) -> int:
    """Millicpu reclaimed work may hold: the headroom the agent measured
    (``state.reclaim_millicpu``), else the reclaim pool's cpus."""
    if state.reclaim_millicpu is not None:
        return max(0, state.reclaim_millicpu)
    return len(pools(topo, state).reclaimed) * 1000


def _all_mems(topo: Topology) -> Tuple[int, ...]:
    return tuple(n.id for n in topo.numa_nodes if n.memory_bytes != 0)


def _gpus_by_node(topo: Topology, state: State) -> Dict[Optional[int], List[str]]:
    used = {g for a in state.allocations for g in a.gpus}
    free: Dict[Optional[int], List[str]] = {}
    for gpu in topo.gpus:
        if gpu.pci not in used:
            free.setdefault(gpu.numa, []).append(gpu.pci)
    return free


def allocate(topo: Topology, state: State, request: Request) -> Decision:
    """Admit ``request`` against ``state``; the caller adds the result to the state.

    1. Reject a name in use and sizes no node state could ever satisfy.
    2. system_cores: admitted onto the reserved pool.
    3. shared_cores: admitted if the shared pool can grow to the new need
       (shrinking what is lent to reclaim).
    4. reclaimed_cores: admitted if the reclaim pool has the millicpu free.
    5. dedicated_cores: ``_dedicated`` picks the cpus (and nodes, GPUs).
    """
    if state.get(request.name) is not None:
        return Rejection(request.name, f"name {request.name!r} is already in use")
    online = topo.online_cpus()
    if request.qos is QoS.SYSTEM:
        return Allocation(name=request.name, qos=QoS.SYSTEM, millicpu=request.millicpu, mems=_all_mems(topo))
    lay = _layout(topo, state)
    usable = len(online) - len(lay.reserved)
    if request.qos is QoS.SHARED:
        need = -(-(state.totals.shared_millicpu + request.millicpu) // 1000)
        if need > usable:
            return Rejection(request.name, f"asks {request.millicpu} millicpu; the node has {usable} cpus "
                                           f"outside the reserved pool")
        if need > len(lay.free):
            return Rejection(request.name, f"shared pool would need {need} cpus; only {len(lay.free)} are not "
                                           f"reserved, dedicated or held by NUMA-exclusive workloads")
        return Allocation(name=request.name, qos=QoS.SHARED, millicpu=request.millicpu, mems=_all_mems(topo),
                          limit_millicpu=request.limit_millicpu)
    if request.qos is QoS.RECLAIMED:
        pool = pools(topo, state)
        if not pool.reclaimed and not set(pool.shared) - set(pool.held_back):
            return Rejection(request.name, "no cpu is left for reclaimed work (every cpu is reserved, dedicated or "
                                           "an SMT sibling of a dedicated cpu; the reserved pool is never lent)")
        capacity_m = reclaimed_capacity(topo, state)
        used_m = state.totals.reclaimed_millicpu
        if used_m + request.millicpu > capacity_m:
            return Rejection(request.name, f"reclaim pool has {capacity_m - used_m} of {capacity_m} millicpu "
                                           f"free; asked {request.millicpu}")
        return Allocation(name=request.name, qos=QoS.RECLAIMED, millicpu=request.millicpu, tier=request.tier,
                          mems=_all_mems(topo))
    return _dedicated(topo, state, lay, request)


def _dedicated(topo: Topology, state: State, lay: _Layout, request: Request) -> Decision:
    """Exclusive cpus for a dedicated request.

    1. Sizes: more cpus than the node has outside the reserved pool is never
       possible; ``require_whole_cores`` needs a multiple of threads per core.
    2. Whole cores are promised when the count is a multiple of the threads
       per core and enough fully free cores exist; otherwise threads.
    3. NUMA binding within one node: candidate nodes not held by others, with
       the capacity (and free GPUs when asked); best fit (least capacity),
       then the lowest id. ``numa_exclusive`` also needs the node free of
       other dedicated cpus, and holds it.
    4. Binding larger than the biggest node: the fewest whole free nodes
       (closest together by NUMA distance), all held.
    5. No binding: ``take_cpus`` over the free cpus, preferring the NUMA node
       of the requested GPUs or NIC.
    6. In every case the shared pool must keep the cpus its requests need.
    """
    name, count = request.name, request.cpus
    tpc = topo.threads_per_core
    usable = len(topo.online_cpus()) - len(lay.reserved)
    if count > usable:
        return Rejection(name, f"asks {count} cpus; the node has {usable} cpus outside the reserved pool")
    if request.require_whole_cores and count % tpc:
        return Rejection(name, f"asks {count} cpus with require_whole_cores; cores here have {tpc} threads")
    spare = len(lay.free) - lay.shared_need
    if count > spare:
        return Rejection(name, f"asks {count} cpus; {spare} are free (the shared pool keeps {lay.shared_need})")
    idx = index(topo)
    whole_first = count % tpc == 0
    free_gpus = _gpus_by_node(topo, state)

    def pick(free: Set[int], prefer: Sequence[int] = ()) -> Optional[Tuple[int, ...]]:
        if whole_first:
            got = take_cpus(topo, free, count, whole_cores=True, prefer_numa=prefer)
            if got is not None or request.require_whole_cores:
                return got
        return take_cpus(topo, free, count, whole_cores=False, prefer_numa=prefer)

    def gpus_on(nodes: Iterable[int]) -> Optional[Tuple[str, ...]]:
        if not request.gpus:
            return ()
        have = [g for n in nodes for g in free_gpus.get(n, [])]
        return tuple(sorted(have)[: request.gpus]) if len(have) >= request.gpus else None

    if request.numa_binding:
        largest = max((len(topo.cpus_in_numa(n)) for n in topo.numa_ids()), default=0)
        if request.single_numa_node and count > largest:
            return Rejection(name, f"asks {count} cpus on one NUMA node (the node's topology policy is "
                                   f"single-numa-node); the largest has {largest}")
        if count <= largest:
            candidates = []
            for node in topo.numa_ids():
                cpus = set(topo.cpus_in_numa(node))
                if not cpus or node in lay.held_nodes:
                    continue
                if request.numa_exclusive and cpus & lay.dedicated:
                    continue
                node_free = cpus & lay.free
                cap = capacity(idx, idx.numa_cores.get(node, ()), node_free, whole_first and request.require_whole_cores)
                if cap < count or gpus_on((node,)) is None:
                    continue
                if request.numa_exclusive and len(lay.free - cpus) < lay.shared_need:
                    continue
                whole_cap = capacity(idx, idx.numa_cores.get(node, ()), node_free, True)
                candidates.append((not (whole_first and whole_cap >= count), cap, node))
            if not candidates:
                why = " exclusively" if request.numa_exclusive else ""
                return Rejection(name, f"no NUMA node can hold {count} cpus{why}"
                                       + (f" with {request.gpus} GPUs" if request.gpus else "")
                                       + " now")
            node = min(candidates)[2]
            cpus = pick(set(topo.cpus_in_numa(node)) & lay.free)
            if cpus is None:
                return Rejection(name, f"NUMA node {node} cannot give {count} whole cores")
            return Allocation(name=name, qos=QoS.DEDICATED, millicpu=count * 1000, cpus=cpus, mems=(node,),
                              nodes=(node,) if request.numa_exclusive else (), gpus=gpus_on((node,)) or (),
                              numa_binding=True, numa_exclusive=request.numa_exclusive,
                              reclaim_allowed=request.reclaim_allowed)
        return _multi_node(topo, state, lay, request, pick, gpus_on)

    prefer: List[int] = []
    gpus: Tuple[str, ...] = ()
    if request.gpus:
        # GPUs from the nodes with the most free GPUs (one node if it can), then cpus near them
        nodes = sorted(free_gpus, key=lambda n: (len(free_gpus[n]) < request.gpus, -len(free_gpus[n]),
                                                 -1 if n is None else n))
        ordered = [g for n in nodes for g in free_gpus[n]]
        if len(ordered) < request.gpus:
            return Rejection(name, f"asks {request.gpus} GPUs; {len(ordered)} are free")
        gpus = tuple(sorted(ordered[: request.gpus]))
        gpu_numa = {g.pci: g.numa for g in topo.gpus}
        prefer = sorted({gpu_numa[g] for g in gpus if gpu_numa[g] is not None})
    if request.nic:
        nic = next((n for n in topo.nics if n.name == request.nic), None)
        if nic is None:
            return Rejection(name, f"no NIC named {request.nic!r} on this node")
        if nic.numa is not None and nic.numa not in prefer:
            prefer.append(nic.numa)
    cpus = pick(lay.free, prefer)
    if cpus is None:
        return Rejection(name, f"cannot find {count} whole cores" if request.require_whole_cores
                         else f"cannot find {count} free cpus")
    return Allocation(name=name, qos=QoS.DEDICATED, millicpu=count * 1000, cpus=cpus, mems=_all_mems(topo),
                      gpus=gpus, reclaim_allowed=request.reclaim_allowed)


def _multi_node(topo: Topology, state: State, lay: _Layout, request: Request, pick, gpus_on) -> Decision:
    """Step 4 of ``_dedicated``: the fewest whole free nodes, closest together."""
    import itertools

    name, count = request.name, request.cpus
    whole_nodes = []
    for node in topo.numa_ids():
        cpus = set(topo.cpus_in_numa(node))
        if cpus and node not in lay.held_nodes and not (cpus & lay.dedicated):
            whole_nodes.append((node, len(cpus & lay.free)))
    sizes = sorted((size for _, size in whole_nodes), reverse=True)
    k, total = 0, 0
    while k < len(sizes) and total < count:
        total += sizes[k]
        k += 1
    if total < count:
        return Rejection(name, f"asks {count} NUMA-bound cpus; the whole free NUMA nodes hold {total}")
    best = None
    combos = itertools.combinations(sorted(whole_nodes), k)
    for combo in itertools.islice(combos, 20000):
        nodes = [n for n, _ in combo]
        cap = sum(size for _, size in combo)
        if cap < count or gpus_on(nodes) is None:
            continue
        node_cpus = {c for n in nodes for c in topo.cpus_in_numa(n)}
        if len(lay.free - node_cpus) < lay.shared_need:
            continue
        spread = sum(topo.distance(a, b) or 0 for a in nodes for b in nodes)
        key = (spread, cap, nodes)
        if best is None or key < best:
            best = key
    if best is None:
        return Rejection(name, f"no set of {k} whole NUMA nodes can hold {count} cpus now")
    nodes = best[2]
    cpus = pick({c for n in nodes for c in topo.cpus_in_numa(n)} & lay.free)
    if cpus is None:
        return Rejection(name, f"NUMA nodes {format_cpulist(nodes)} cannot give {count} cpus")
    return Allocation(name=name, qos=QoS.DEDICATED, millicpu=count * 1000, cpus=cpus, mems=tuple(nodes),
                      nodes=tuple(nodes), gpus=gpus_on(nodes) or (), numa_binding=True,
                      numa_exclusive=request.numa_exclusive, reclaim_allowed=request.reclaim_allowed)


def release(state: State, name: str) -> State:
    if state.get(name) is None:
        raise AdmissionError(f"no workload named {name!r}")
    return state.without(name)

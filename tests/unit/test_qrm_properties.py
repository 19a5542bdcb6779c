"""Property tests of the QoS policy over random topologies and request sequences.

Topologies: random synthetic shapes (sockets, NUMA per socket, cores, SMT,
L3 split, offline cpus, GPUs) and every hwloc snapshot. Sequences mix
dedicated (bound, exclusive, whole-core, GPU), shared and reclaimed requests
with releases.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile

from hypothesis import HealthCheck, given, settings, strategies as st

from agent.qrm.model import Allocation, QoS, Rejection, Request, Tier
from agent.qrm.policy import _layout, allocate, initial_state, pools, release
from agent.qrm.takeby import capacity, index, is_whole_cores
from agent.topology import HostFS, discover
from agent.topology.synthetic import Shape, build_topology
from tests.conftest import HWLOC_DIR, hwloc_cases


@functools.lru_cache(maxsize=None)
def hwloc_topology(name: str):
    base = tempfile.mkdtemp(prefix="tidal-hwloc-")
    atexit.register(shutil.rmtree, base, True)  # discovered once per tree (cached), removed when pytest ends
    subprocess.run(["tar", "-xjf", str(HWLOC_DIR / f"{name}.tar.bz2"), "-C", base], check=True)
    root = dict(hwloc_cases())[name]["root"]
    return discover(HostFS(f"{base}/{root}"))


shapes = st.builds(
    Shape,
    sockets=st.integers(1, 2), numa_per_socket=st.integers(1, 3), cores_per_numa=st.integers(1, 6),
    threads_per_core=st.sampled_from([1, 2, 4]), l3_per_numa=st.integers(1, 2),
    gpus=st.lists(st.integers(0, 1), max_size=3).map(tuple),
)
synthetic = shapes.map(build_topology)
fixtures = st.sampled_from([name for name, _ in hwloc_cases()]).map(hwloc_topology)
topologies = st.one_of(synthetic, fixtures)


@st.composite
def request_docs(draw):
    kind = draw(st.sampled_from(["dedicated", "dedicated", "bound", "exclusive", "shared", "reclaimed", "gpu"]))
    if kind in ("dedicated", "bound", "exclusive", "gpu"):
        return dict(qos=QoS.DEDICATED, cpus=draw(st.one_of(st.integers(1, 6), st.integers(1, 40))), numa_binding=kind in ("bound", "exclusive"),
                    numa_exclusive=kind == "exclusive", require_whole_cores=draw(st.booleans()) and kind != "gpu",
                    reclaim_allowed=draw(st.booleans()), gpus=1 if kind == "gpu" else 0)
    if kind == "shared":
        return dict(qos=QoS.SHARED, millicpu=draw(st.integers(100, 8000)))
    return dict(qos=QoS.RECLAIMED, millicpu=draw(st.integers(100, 8000)),
                tier=draw(st.sampled_from(list(Tier))))


steps = st.lists(st.one_of(request_docs(), st.integers(0, 50).map(lambda i: ("release", i))), min_size=1, max_size=25)


def make_request(i, doc):
    doc = dict(doc)
    if doc["qos"] is QoS.DEDICATED:
        doc["millicpu"] = doc["cpus"] * 1000
    return Request(name=f"w{i}", **doc)


def lendable_by_owner(state):
    return {c for a in state.allocations if a.qos is QoS.DEDICATED and a.reclaim_allowed for c in a.cpus}


def check_pools(topo, state):
    pool = pools(topo, state)
    online = set(topo.online_cpus())
    reserved, shared, dedicated = set(pool.reserved), set(pool.shared), set(pool.dedicated)
    reclaimed, lendable, idle = set(pool.reclaimed), set(pool.lendable), set(pool.idle)
    assert not (reserved & shared) and not (reserved & dedicated) and not (shared & dedicated)
    assert not (reclaimed - lendable) & (reserved | dedicated | shared)
    assert reclaimed & dedicated <= {c for a in state.allocations if a.reclaim_allowed for c in a.cpus}
    assert reserved | shared | dedicated | reclaimed | idle == online
    need = -(-sum(a.millicpu for a in state.allocations if a.qos is QoS.SHARED) // 1000)
    assert len(shared) >= need
    # dedicated sets pairwise disjoint
    seen = set()
    for alloc in state.allocations:
        if alloc.qos is QoS.DEDICATED:
            assert not seen & set(alloc.cpus)
            seen |= set(alloc.cpus)
    # reclaimed work never on an SMT sibling of a dedicated cpu whose owner does not lend it (harvest or not)
    idx = index(topo)
    # (a sibling may be another workload's dedicated cpu that it lends: held back too)
    guarded = {s for a in state.allocations if a.qos is QoS.DEDICATED and not a.reclaim_allowed
               for c in a.cpus for s in idx.core_cpus[topo.cpu(c).core] if s not in a.cpus} - reserved
    from agent.qrm.assignment import reclaimed_cpus

    for harvest in (False, True):
        assert not set(reclaimed_cpus(pool, harvest)) & guarded, (harvest, guarded)
    # status names every one that reclaimed work would otherwise have, and no other
    assert guarded & (shared | idle | lendable_by_owner(state)) <= set(pool.held_back) <= guarded
    # nobody else's dedicated cpus on a held node
    for alloc in state.allocations:
        for node in alloc.nodes:
            others = {c for a in state.allocations if a.name != alloc.name for c in a.cpus}
            assert not others & set(topo.cpus_in_numa(node))
            assert not shared & set(topo.cpus_in_numa(node))


def check_decision(topo, state, request, decision):
    lay = _layout(topo, state)
    tpc = topo.threads_per_core
    spare = len(lay.free) - lay.shared_need
    if isinstance(decision, Allocation):
        assert decision.name == request.name and decision.qos is request.qos
        if request.qos is not QoS.DEDICATED:
            assert decision.cpus == ()
            return
        cpus = set(decision.cpus)
        assert len(cpus) == request.cpus  # exact count
        assert cpus <= lay.free  # not reserved, dedicated or held by others
        assert spare >= request.cpus  # the shared pool keeps its need
        if request.require_whole_cores:
            assert is_whole_cores(topo, frozenset(cpus))
        if request.numa_binding:
            assert {topo.cpu(c).numa for c in cpus} <= set(decision.mems)
            if len(decision.mems) == 1:
                assert set(topo.cpus_in_numa(decision.mems[0])) >= cpus
            else:
                assert request.cpus > max(len(topo.cpus_in_numa(n)) for n in topo.numa_ids())
        if request.gpus:
            assert len(decision.gpus) == request.gpus
        idx = index(topo)
        if (request.cpus % tpc == 0 and not request.numa_binding and not request.gpus
                and capacity(idx, idx.core_cpus, lay.free, True) >= request.cpus):
            assert is_whole_cores(topo, frozenset(cpus)), "whole cores were promised"
        return
    assert isinstance(decision, Rejection) and decision.reason
    # nothing rejected when it fits
    if request.qos is QoS.SHARED:
        assert -(-(lay.shared_need * 1000 + request.millicpu) // 1000) > len(lay.free) or \
            -(-(sum(a.millicpu for a in state.allocations if a.qos is QoS.SHARED) + request.millicpu) // 1000) > len(lay.free)
    elif request.qos is QoS.RECLAIMED:
        pool = pools(topo, state)
        used = sum(a.millicpu for a in state.allocations if a.qos is QoS.RECLAIMED)
        assert used + request.millicpu > len(pool.reclaimed) * 1000
    elif request.qos is QoS.DEDICATED and not request.numa_binding and not request.gpus \
            and not request.require_whole_cores:
        assert request.cpus > spare
    elif request.qos is QoS.DEDICATED and request.numa_binding and not request.numa_exclusive \
            and not request.gpus and not request.require_whole_cores:
        largest = max(len(topo.cpus_in_numa(n)) for n in topo.numa_ids())
        if request.cpus <= largest and request.cpus <= spare:
            fits = [n for n in topo.numa_ids() if n not in lay.held_nodes
                    and len(set(topo.cpus_in_numa(n)) & lay.free) >= request.cpus]
            assert not fits, f"rejected although NUMA nodes {fits} fit: {decision.reason}"


def run_sequence(topo, sequence):
    state = initial_state(topo)
    trace = []
    for i, step in enumerate(sequence):
        if isinstance(step, tuple):
            names = state.names()
            if names:
                state = release(state, names[step[1] % len(names)])
            continue
        request = make_request(i, step)
        decision = allocate(topo, state, request)
        check_decision(topo, state, request, decision)
        trace.append(decision)
        if isinstance(decision, Allocation):
            state = state.with_allocation(decision)
        check_pools(topo, state)
    return state, trace


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topo=topologies, sequence=steps)
def test_invariants_hold_over_random_sequences(topo, sequence):
    run_sequence(topo, sequence)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topo=topologies, sequence=steps)
def test_same_input_same_output(topo, sequence):
    assert run_sequence(topo, sequence) == run_sequence(topo, sequence)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, reclaim=st.one_of(st.none(), st.integers(0, 64)), sequence=steps)
def test_reclaim_target_bounds_the_pool(shape, reclaim, sequence):
    topo = build_topology(shape)
    state, _ = run_sequence(topo, sequence)
    state = state.with_reclaim_cpus(reclaim)
    pool = pools(topo, state)
    if reclaim is not None:
        assert len(pool.reclaimed) <= reclaim
    check_pools(topo, state)

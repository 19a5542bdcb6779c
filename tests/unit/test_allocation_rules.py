"""Allocation rules on real machines' trees (hwloc's test suite), for every plan and for the agent alike.

1. The reserved pool is never handed to another level: with ``--reserved-cpus`` set, random request
   sequences (dedicated, shared, reclaimed, in any order) never give a reclaimed (or shared, or
   dedicated) workload a reserved cpu; reclaimed work that a later request leaves with no cpu, or over
   the capacity, is evicted, in the plan and in the agent alike.
2. A NUMA-bound workload gets the memory nearest its cpus: where its cpu node has no memory of its own
   (memory-only nodes beside it), the nearest memory nodes by the kernel's distances, never every node.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from agent.qrm.assignment import assignment, memory_nodes
from agent.qrm.model import QoS
from agent.qrm.plan import plan_report, run_plan
from agent.qrm.policy import default_reserved, initial_state, pools
from agent.qrm.requests import machine_limits, parse_request
from agent.topology import HostFS, discover
from tests.conftest import hwloc_cases

MEMTIERS = Path(__file__).resolve().parents[1] / "fixtures" / "hwloc-memtiers"
SEQUENCES = 12


@pytest.fixture(scope="module")
def memtier_topologies(tmp_path_factory):
    base = tmp_path_factory.mktemp("memtiers")
    found = {}
    for archive in sorted(MEMTIERS.glob("*.tar.bz2")):
        subprocess.run(["tar", "-xjf", str(archive), "-C", str(base)], check=True)
        name = archive.name[: -len(".tar.bz2")]
        found[name] = discover(HostFS(str(base / name)))
    return found


def topologies(hwloc_topologies, memtier_topologies):
    return {**hwloc_topologies, **memtier_topologies}


def random_requests(topo, rng):
    online = len(topo.online_cpus())
    docs = []
    for i in range(rng.randrange(4, 14)):
        kind = rng.choice(["dedicated", "dedicated", "shared", "reclaimed", "reclaimed"])
        if kind == "dedicated":
            doc = {"name": f"d{i}", "qos": "dedicated_cores", "cpus": rng.randrange(1, max(2, online // 2))}
            if rng.random() < 0.4:
                doc["numa_binding"] = True
        elif kind == "shared":
            doc = {"name": f"s{i}", "qos": "shared_cores", "millicpu": rng.randrange(100, 1000 * max(1, online // 4))}
        else:
            doc = {"name": f"r{i}", "qos": "reclaimed_cores", "millicpu": rng.randrange(100, min(3000, 1000 * online)),
                   "tier": rng.choice(["low", "min", "high"])}
        docs.append(doc)
    return [parse_request(d, machine_limits(topo)) for d in docs]


CASES = [name for name, _ in hwloc_cases()] + sorted(p.name[: -len(".tar.bz2")] for p in MEMTIERS.glob("*.tar.bz2"))


@pytest.mark.parametrize("name", CASES)
def test_no_plan_hands_a_reserved_cpu_to_anyone(hwloc_topologies, memtier_topologies, name):
    topo = topologies(hwloc_topologies, memtier_topologies)[name]
    reserved = default_reserved(topo)  # the first core (its first thread where it is the whole machine)
    assert reserved
    rng = random.Random(f"{name}-reserved")
    for _ in range(SEQUENCES):
        state, rejected = run_plan(topo, initial_state(topo, reserved), random_requests(topo, rng))
        report = plan_report(topo, state, rejected)
        for entry in report["assignments"]:
            assert not set(entry["cpus"]) & set(reserved), (entry, reserved)
        capacity_left = [r for r in rejected if "millicpu free" in r.reason and "-" in r.reason.split("has", 1)[1]]
        assert not capacity_left, capacity_left  # never "has -3000 of 0 millicpu free"
        pool = pools(topo, state)
        if not pool.reclaimed and not pool.shared:  # nothing left for reclaimed work: none of it stays
            assert not [a for a in state.allocations if a.qos is QoS.RECLAIMED]


def test_reclaimed_work_a_dedicated_request_leaves_with_no_cpu_is_evicted_not_put_on_the_reserved_cpus(
        hwloc_topologies):
    # the case that was reported: 8 cpus, reserved 0, reclaimed work first, then dedicated 1-7
    topo = hwloc_topologies["8em64t-2s2ca2c"]
    requests = [parse_request(d) for d in (
        {"name": "r2", "qos": "reclaimed_cores", "millicpu": 1000}, {"name": "r3", "qos": "reclaimed_cores",
                                                                      "millicpu": 2000},
        {"name": "d", "qos": "dedicated_cores", "cpus": 7}, {"name": "r4", "qos": "reclaimed_cores", "millicpu": 1})]
    state, rejected = run_plan(topo, initial_state(topo, (0,)), requests)
    assert [a.name for a in state.allocations] == ["d"]
    reasons = {r.name: r.reason for r in rejected}
    assert set(reasons) == {"r2", "r3", "r4"}
    assert reasons["r2"].startswith("evicted") and reasons["r3"].startswith("evicted")
    assert "no cpu is left for reclaimed work" in reasons["r4"]


def test_the_agent_evicts_what_the_plan_evicts(hwloc_topologies, make_agent):
    topo = hwloc_topologies["8em64t-2s2ca2c"]
    agent = make_agent(topo, reserved_cpus=(0,), resize=False)
    try:
        agent.admit({"name": "r2", "qos": "reclaimed_cores", "millicpu": 1000})
        agent.admit({"name": "d", "qos": "dedicated_cores", "cpus": 7})
        assert agent.state.names() == ["d"]  # at once, before the kernel was told
        assert [e["name"] for e in agent.eviction.evictions] == ["r2"] and "no cpu is left" in agent.eviction.evictions[0]["reason"]
        assert "0" not in agent.driver.files.get("tidal/reclaimed/low/r2", {}).get(("cpuset", "cpuset.cpus"), "")
        from agent.errors import TidalError

        with pytest.raises(TidalError, match="no cpu is left for reclaimed work"):
            agent.admit({"name": "r4", "qos": "reclaimed_cores", "millicpu": 1})
    finally:
        agent.shutdown()


@pytest.mark.parametrize("name", sorted(p.name[: -len(".tar.bz2")] for p in MEMTIERS.glob("*.tar.bz2")))
def test_numa_bound_work_gets_the_memory_nearest_its_cpus(memtier_topologies, name):
    topo = memtier_topologies[name]
    every = set(memory_nodes(topo))
    for node in [n.id for n in topo.numa_nodes if n.cpus]:
        count = len(topo.cpus_in_numa(node))
        state = initial_state(topo, ())
        from agent.qrm.policy import allocate

        alloc = allocate(topo, state, parse_request({"name": "db", "qos": "dedicated_cores", "cpus": count,
                                                     "numa_binding": True}))
        state = state.with_allocation(alloc)
        given = assignment(topo, alloc, pools(topo, state), harvest=False)
        assert set(given.cpus) <= set(topo.cpus_in_numa(node)) or alloc.mems != (node,)
        bound = alloc.mems[0]
        distances = {m: topo.distance(bound, m) for m in every}
        nearest = min(distances.values())
        assert set(given.mems) <= every and given.mems
        assert all(distances[m] == nearest for m in given.mems), (bound, given.mems, distances)
        if bound not in every:
            assert set(given.mems) != every  # never every memory node, the far tiers included


def test_the_reported_machine_binds_each_cpu_node_to_its_own_dram(memtier_topologies):
    topo = memtier_topologies["fakememinitiators-1np2c+1npp+gi"]
    want = {0: (5,), 1: (8,), 2: (6,), 3: (9,)}  # hwloc's reading: each DRAM node beside its cpus (distance 11)
    from agent.qrm.policy import allocate

    for node, mems in want.items():
        state = initial_state(topo, ())
        cpus = topo.cpus_in_numa(node)
        alloc = allocate(topo, state, parse_request({"name": "x", "qos": "dedicated_cores", "cpus": len(cpus),
                                                     "numa_binding": True}))
        state = state.with_allocation(alloc)
        if alloc.mems != (node,):
            continue  # bound elsewhere: the loop covers that node in its turn
        assert assignment(topo, alloc, pools(topo, state), harvest=False).mems == mems


def test_each_cpu_has_one_owner_in_status_a_dedicated_owner_before_its_lent_pool():
    from agent.qrm.assignment import cpu_owners
    from agent.qrm.model import Allocation, Pools

    pools = Pools(reserved=(0,), shared=(1, 2), reclaimed=(3, 6, 7), dedicated=(4, 5, 6, 7), idle=(8,), lendable=(6, 7))
    web = Allocation(name="web", qos=QoS.DEDICATED, cpus=(4, 5, 6, 7), millicpu=4000)
    owners = cpu_owners(pools, [web])
    assert owners == {0: ("reserved", None), 1: ("shared", None), 2: ("shared", None), 3: ("reclaimed", None),
                      4: ("dedicated", "web"), 5: ("dedicated", "web"), 6: ("dedicated", "web"),
                      7: ("dedicated", "web"), 8: ("held-idle", None)}
    assert 9 not in owners  # in no pool: the caller shows it unassigned

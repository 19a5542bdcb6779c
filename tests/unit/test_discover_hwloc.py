"""Conformance: Tidal's discovery equals hwloc's own reading of real machines.

The snapshots and their ``*.expected.json`` come from hwloc's test suite
(BSD licence, ``tests/fixtures/hwloc/COPYING``): x86, ARM, POWER, s390 and
ia64 machines with irregular numbering.
"""

import pytest

from tests.conftest import hwloc_cases

CASES = hwloc_cases()
IDS = [name for name, _ in CASES]


@pytest.mark.parametrize("name,expected", CASES, ids=IDS)
def test_online_cpus(hwloc_topologies, name, expected):
    assert list(hwloc_topologies[name].online_cpus()) == expected["pus"]


@pytest.mark.parametrize("name,expected", CASES, ids=IDS)
def test_cores(hwloc_topologies, name, expected):
    topo = hwloc_topologies[name]
    got = sorted(list(topo.cpus_in_core(c)) for c in topo.core_ids())
    assert got == sorted(expected["cores"])


@pytest.mark.parametrize("name,expected", CASES, ids=IDS)
def test_sockets(hwloc_topologies, name, expected):
    topo = hwloc_topologies[name]
    got = sorted(list(topo.cpus_in_socket(s)) for s in topo.socket_ids())
    assert got == sorted(expected["sockets"])


@pytest.mark.parametrize("name,expected", CASES, ids=IDS)
def test_numa_nodes(hwloc_topologies, name, expected):
    topo = hwloc_topologies[name]
    got = {str(n.id): {"cpus": list(n.cpus), "memory_only": n.memory_only, "memory_bytes": n.memory_bytes}
           for n in topo.numa_nodes}
    want = {k: {"cpus": v["cpus"], "memory_only": v["memory_only"], "memory_bytes": v["memory_bytes"]}
            for k, v in expected["numa"].items()}
    assert got == want


@pytest.mark.parametrize("name,expected", CASES, ids=IDS)
def test_gpus_and_nics(hwloc_topologies, name, expected):
    topo = hwloc_topologies[name]
    gpus = sorted(({"pci": g.pci, "numa": g.numa} for g in topo.gpus), key=lambda g: g["pci"])
    assert gpus == sorted(expected["gpus"], key=lambda g: g["pci"])
    nics = sorted(({"name": n.name, "numa": n.numa} for n in topo.nics), key=lambda n: n["name"])
    assert nics == sorted(expected["nics"], key=lambda n: n["name"])


@pytest.mark.parametrize("name,expected", CASES, ids=IDS)
def test_structure_is_consistent(hwloc_topologies, name, expected):
    """Beyond hwloc's fields: every online cpu has a unique core; cores nest in
    sockets; siblings equal the core's cpus; NUMA ids of cpus agree with nodes."""
    topo = hwloc_topologies[name]
    assert not topo.warnings
    seen = set()
    for core in topo.core_ids():
        cpus = topo.cpus_in_core(core)
        assert not seen.intersection(cpus)
        seen.update(cpus)
        assert len({topo.cpu(c).socket for c in cpus}) == 1
        for c in cpus:
            assert topo.cpu(c).siblings == cpus
    assert seen == set(topo.online_cpus())
    for node in topo.numa_nodes:
        for c in node.cpus:
            assert topo.cpu(c).numa == node.id


def test_known_details(hwloc_topologies):
    """Facts of particular machines that a naive reader gets wrong."""
    ppc = hwloc_topologies["256ppc-8n8s4t"]
    assert ppc.numa_ids() == (0, 1, 4, 5, 8, 9, 12, 13)  # sparse node ids
    assert ppc.distance(0, 1) == 20 and ppc.distance(0, 4) == 40
    assert ppc.threads_per_core == 4
    amd = hwloc_topologies["64amd64-4s2n4ca2co"]
    assert amd.threads_per_core == 1  # Bulldozer compute units are not SMT threads
    s390 = hwloc_topologies["20s390-2g6s4c"]
    assert len(s390.core_ids()) == 20  # core_id repeats across cores on s390
    intel = hwloc_topologies["32intel64-2p8co2t+8ve"]
    assert intel.offline_cpus() == ()  # 32-111 are possible but not present
    assert {n.name: n.pci for n in intel.nics} == {"enp96s0f0": "0000:60:00.0", "enp96s0f1": "0000:60:00.1"}
    assert len(intel.l3_ids()) == 2
    arm = hwloc_topologies["128arm-2pa2n8cluster4co"]
    assert len(arm.die_ids()) == 2  # die_id -1: one die per package

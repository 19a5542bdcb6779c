"""Discovery on synthetic trees: shapes, old kernels, odd machines, devices."""

import os

import pytest

from agent.topology import HostFS, discover
from agent.topology.synthetic import FakeNic, Shape, layout, write_tree


def _discover(tmp_path, shape):
    write_tree(str(tmp_path), shape)
    return discover(HostFS(str(tmp_path)))


SHAPES = [
    Shape(),
    Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, threads_per_core=1),
    Shape(sockets=4, numa_per_socket=2, cores_per_numa=6, threads_per_core=2, l3_per_numa=2),
    Shape(sockets=2, numa_per_socket=1, cores_per_numa=8, threads_per_core=4),
    Shape(masks_only=True),
]


@pytest.mark.parametrize("shape", SHAPES, ids=["2s2n8c2t", "1s1n4c1t", "4s2n6c2t-2l3", "2s1n8c4t-smt4", "masks-only"])
def test_shape_is_read_back_exactly(tmp_path, shape):
    topo = _discover(tmp_path, shape)
    truth = layout(shape)
    assert len(topo.online_cpus()) == shape.cpus
    assert len(topo.core_ids()) == shape.cores
    assert len(topo.socket_ids()) == shape.sockets
    assert len(topo.numa_nodes) == shape.numa_count()
    assert len(topo.l3_ids()) == shape.numa_count() * shape.l3_per_numa
    assert topo.threads_per_core == shape.threads_per_core
    for cpu in truth:
        got = topo.cpu(cpu["id"])
        assert got.siblings == tuple(sorted(cpu["siblings"]))
        assert got.numa == cpu["numa"]
        assert topo.cpus_in_core(got.core) == tuple(sorted(cpu["siblings"]))
    for node in topo.numa_nodes:
        assert node.memory_bytes == shape.memory_per_numa
        assert node.distance_to(node.id) == 10
    assert topo.cpu_model == shape.model and "avx2" in topo.cpu_flags
    assert not topo.warnings


def test_queries_on_dual_socket(topo_dual_socket_ht):
    topo = topo_dual_socket_ht
    assert topo.cores_in_numa(0) == tuple(range(8))
    assert topo.cpus_in_numa(0) == tuple(range(8)) + tuple(range(32, 40))
    assert topo.cores_in_socket(1) == tuple(range(16, 32))
    assert topo.cpus_in_core(3) == (3, 35)
    assert topo.core_of(35) == 3 and topo.numa_of(35) == 0
    assert topo.distance(0, 1) == 12 and topo.distance(0, 2) == 32
    assert [g.numa for g in topo.gpus] == [0, 1, 2, 3]
    assert {n.name: (n.numa, n.speed_mbps, n.physical) for n in topo.nics} == {
        "eth0": (0, 25000, True), "eth1": (2, 25000, True), "lo": (None, None, False)}


def test_offline_cpus_are_listed_but_not_grouped(tmp_path):
    topo = _discover(tmp_path, Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, offline=(3, 7)))
    assert topo.offline_cpus() == (3, 7)
    assert 3 not in topo.online_cpus()
    assert topo.cpu(7).core is None and not topo.cpu(7).online
    assert topo.cpus_in_core(topo.core_of(3 - 3 + 0)) == (0, 4)
    # core 3 has no online thread left: it is gone from the core list
    assert len(topo.core_ids()) == 3


def test_no_node_dir_means_one_node_with_all_memory(tmp_path):
    shape = Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, no_node_dir=True)
    topo = _discover(tmp_path, shape)
    assert topo.numa_ids() == (0,)
    assert topo.numa_node(0).cpus == topo.online_cpus()
    assert topo.numa_node(0).memory_bytes == shape.memory_per_numa


def test_memory_only_node(tmp_path):
    topo = _discover(tmp_path, Shape(sockets=1, numa_per_socket=2, cores_per_numa=2, memory_only_nodes=1))
    node = topo.numa_node(2)
    assert node.memory_only and node.cpus == () and node.memory_bytes == 16 * 1024 ** 3
    assert topo.cores_in_numa(2) == ()
    assert topo.distance(0, 2) == 32


def test_cpu_without_topology_falls_back_to_cpuinfo(tmp_path):
    shape = Shape(sockets=2, numa_per_socket=1, cores_per_numa=2, threads_per_core=1, no_topology=(3,))
    topo = _discover(tmp_path, shape)
    # cpu 3 lacks sysfs topology: /proc/cpuinfo says physical id 1
    assert topo.cpu(3).socket == topo.cpu(2).socket
    assert topo.cpu(3).core != topo.cpu(2).core
    assert len(topo.core_ids()) == 4


def test_no_topology_and_no_cpuinfo_ids_warns(tmp_path):
    shape = Shape(sockets=1, numa_per_socket=1, cores_per_numa=2, threads_per_core=1, no_topology=(1,))
    write_tree(str(tmp_path), shape)
    (tmp_path / "proc" / "cpuinfo").write_text("processor : 0\n\nprocessor : 1\n")
    topo = discover(HostFS(str(tmp_path)))
    assert any("cpu1" in w for w in topo.warnings)
    assert len(topo.core_ids()) == 2


def test_numa_node_without_meminfo_warns(tmp_path):
    write_tree(str(tmp_path), Shape(sockets=1, numa_per_socket=2, cores_per_numa=2))
    os.remove(tmp_path / "sys/devices/system/node/node1/meminfo")
    topo = discover(HostFS(str(tmp_path)))
    assert topo.numa_node(1).memory_bytes is None
    assert any("node 1" in w for w in topo.warnings)


def test_cpuinfo_only_tree(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cpuinfo").write_text(
        "processor : 0\nphysical id : 0\ncore id : 0\nmodel name : Old\n\n"
        "processor : 1\nphysical id : 0\ncore id : 0\n\n"
        "processor : 2\nphysical id : 1\ncore id : 0\n\n")
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 1024 kB\n")
    topo = discover(HostFS(str(tmp_path)))
    assert topo.online_cpus() == (0, 1, 2)
    assert topo.cpus_in_core(topo.core_of(0)) == (0, 1)
    assert len(topo.socket_ids()) == 2
    assert topo.numa_node(0).memory_bytes == 1024 * 1024
    assert any("/proc/cpuinfo" in w for w in topo.warnings)


def test_gpu_numa_from_local_cpulist_when_numa_node_is_minus_one(tmp_path):
    write_tree(str(tmp_path), Shape(gpus=(2,)))
    device = tmp_path / "sys/devices/pci0000:10/0000:10:00.0"
    (device / "numa_node").write_text("-1\n")
    topo = discover(HostFS(str(tmp_path)))
    assert topo.gpus[0].numa == 2


def test_nvidia_proc_lists_gpus_the_class_scan_missed(tmp_path):
    write_tree(str(tmp_path), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    (tmp_path / "proc/driver/nvidia/gpus/0000:3b:00.0").mkdir(parents=True)
    topo = discover(HostFS(str(tmp_path)))
    assert [(g.pci, g.vendor, g.numa) for g in topo.gpus] == [("0000:3b:00.0", "nvidia", 0)]


def test_absolute_symlinks_stay_inside_the_root(tmp_path):
    write_tree(str(tmp_path), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2, nics=(FakeNic("eth9", 0),)))
    link = tmp_path / "sys/class/net/eth9"
    link.unlink()
    link.symlink_to("/sys/devices/pci0000:80/0000:80:00.0/net/eth9")  # absolute, as some captures have
    topo = discover(HostFS(str(tmp_path)))
    nic = next(n for n in topo.nics if n.name == "eth9")
    assert nic.pci == "0000:80:00.0" and nic.physical


def test_live_host_discovers_something():
    topo = discover(HostFS("/"), use_cpuinfo_lib=False)
    assert len(topo.online_cpus()) == os.cpu_count()
    assert topo.numa_nodes and all(n.memory_bytes for n in topo.numa_nodes if n.cpus)


def test_the_live_hosts_model_and_flags_are_the_kernels_without_a_cpuid_process(monkeypatch):
    """The agent's start reads the kernel's /proc/cpuinfo; py-cpuinfo's CPUID process (1.1 s) is not asked."""
    import cpuinfo

    from agent.topology.parse import cpuinfo_model_and_flags, iter_cpuinfo

    asked = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or {})
    topo = discover(HostFS("/"))
    with open("/proc/cpuinfo") as handle:
        model, flags = cpuinfo_model_and_flags(iter_cpuinfo(handle.read()))
    assert (topo.cpu_model, topo.cpu_flags) == (model, flags) and model and asked == []


def test_py_cpuinfo_names_the_cpu_where_the_kernel_does_not(monkeypatch):
    import cpuinfo

    from agent.topology.discover import _Reader, _model_and_flags

    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: {"brand_raw": "Some Cpu", "flags": ["b", "a", "b"]})
    assert _model_and_flags(_Reader(HostFS("/")), "processor\t: 0\n", True) == ("Some Cpu", ("a", "b"))
    assert _model_and_flags(_Reader(HostFS("/")), "processor\t: 0\n", False) == (None, ())

    def broken():
        raise RuntimeError("no cpuid here")

    monkeypatch.setattr(cpuinfo, "get_cpu_info", broken)
    reader = _Reader(HostFS("/"))
    assert _model_and_flags(reader, "", True) == (None, ())
    assert any("no cpuid here" in w for w in reader.warnings)


def test_to_dict_round_trip(topo_dual_socket_ht):
    from agent.topology import Topology

    again = Topology.from_dict(topo_dual_socket_ht.to_dict())
    assert again == topo_dual_socket_ht
    assert again.cores_in_numa(3) == topo_dual_socket_ht.cores_in_numa(3)


@pytest.mark.parametrize("shape", SHAPES[:4] + [Shape(sockets=1, numa_per_socket=2, cores_per_numa=3, offline=(2, 9))],
                         ids=["2s2n8c2t", "1s1n4c1t", "4s2n6c2t-2l3", "2s1n8c4t-smt4", "offline"])
def test_in_memory_topology_equals_discovered(tmp_path, shape):
    from agent.topology.synthetic import build_topology

    discovered = _discover(tmp_path, shape)
    built = build_topology(shape)
    assert [(c.id, c.online, c.core, c.socket, c.numa, c.l3, c.siblings) for c in built.cpus] == \
           [(c.id, c.online, c.core, c.socket, c.numa, c.l3, c.siblings) for c in discovered.cpus]
    assert built.numa_nodes == discovered.numa_nodes


def test_an_empty_attribute_file_is_unknown_with_a_warning(tmp_path):
    """#17: a captured tree with an empty cpu ``online`` file stopped discovery with "not an integer: ''"."""
    from agent.topology.synthetic import Shape, write_tree

    write_tree(str(tmp_path), Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, threads_per_core=1))
    os.remove(tmp_path / "sys/devices/system/cpu/online")  # so the per-cpu files are read
    for cpu in (1, 2):
        (tmp_path / f"sys/devices/system/cpu/cpu{cpu}/online").write_text("")
    topo = discover(HostFS(str(tmp_path)))
    assert topo.online_cpus() == (0, 1, 2, 3)  # unknown: taken as online, as hwloc does
    assert any("2 attribute file(s) exist but are empty" in w and "cpu1/online" in w for w in topo.warnings)

"""`tidal topology` and `tidal bench topology`: contract, table, bad input."""

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.topology import HostFS, discover
from agent.topology.synthetic import FakeNic, Shape, write_tree
from tests.conftest import is_root


@pytest.fixture()
def tree(tmp_path):
    write_tree(str(tmp_path), Shape(gpus=(0, 3), nics=(FakeNic("eth0", 1),)))
    return tmp_path


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_json_contract(tree):
    result = run("topology", "--root", str(tree), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    cpu = data["cpus"][0]
    assert set(cpu) == {"id", "core", "socket", "die", "numa", "l3", "online", "siblings"}
    assert cpu == {"id": 0, "core": 0, "socket": 0, "die": 0, "numa": 0, "l3": 0, "online": True, "siblings": [0, 32]}
    node = data["numa_nodes"][0]
    assert node["cpus"][:2] == [0, 1] and node["memory_bytes"] == 16 * 1024 ** 3
    assert node["distances"] == {"0": 10, "1": 12, "2": 32, "3": 32}
    assert data["gpus"][1] == {"pci": "0000:11:00.0", "vendor": "nvidia", "numa": 3, "model": None,
                               "memory_bytes": None, "uuid": None}
    eth0 = next(n for n in data["nics"] if n["name"] == "eth0")
    assert eth0 == {"name": "eth0", "pci": "0000:80:00.0", "numa": 1, "speed_mbps": 25000,
                    "mac": "02:00:00:00:00:00", "physical": True}


def test_table(tree):
    result = run("topology", "--root", str(tree))
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.startswith("2 sockets, 2 dies, 4 NUMA nodes, 4 L3 groups, 32 cores, 64 cpus online (2 threads/core)")
    # the hierarchy: socket -> numa -> l3 -> cores, in that order
    positions = [out.index(s) for s in ("socket 0", "numa 0", "l3 0", "core 0: 0,32", "socket 1", "numa 2")]
    assert positions == sorted(positions)
    assert "0000:11:00.0  nvidia  3" in out
    assert "eth0  0000:80:00.0  1" in out


def _error_line(result):
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


def test_root_that_is_not_a_sysfs_tree(tmp_path):
    result = run("topology", "--root", str(tmp_path))
    assert result.exit_code == 2
    line = _error_line(result)
    assert line.startswith("tidal: error: ") and "not a sysfs/procfs tree" in line and str(tmp_path) in line


def test_garbage_in_a_cpulist_names_the_file(tree):
    bad = tree / "sys/devices/system/cpu/cpu0/topology/thread_siblings_list"
    bad.write_text("0-x\n")
    result = run("topology", "--root", str(tree), "--json")
    assert result.exit_code == 2
    assert str(bad) in _error_line(result)


def test_garbage_in_cpu_online_names_the_file(tree):
    bad = tree / "sys/devices/system/cpu/online"
    bad.write_text("zero to three\n")
    result = run("topology", "--root", str(tree))
    assert result.exit_code == 2
    assert str(bad) in _error_line(result)


def test_unreadable_file_names_the_file(tree):
    bad = tree / "sys/devices/system/node/node0/meminfo"
    if is_root():
        # root reads through permission bits; a directory in the file's place is unreadable for anyone
        bad.unlink()
        bad.mkdir()
    else:
        bad.chmod(0)
    result = run("topology", "--root", str(tree))
    assert result.exit_code == 2
    line = _error_line(result)
    assert str(bad) in line


@pytest.mark.skipif(is_root(), reason="root bypasses permission bits; the directory case covers root")
def test_unreadable_by_permission(tree):
    bad = tree / "sys/devices/system/cpu/online"
    bad.chmod(0)
    result = run("topology", "--root", str(tree))
    assert result.exit_code == 2 and "permission denied" in _error_line(result).lower()


def test_odd_tree_is_discovered_with_a_warning(tree):
    shutil.rmtree(tree / "sys/devices/system/cpu/cpu5/topology")
    os.remove(tree / "sys/devices/system/node/node2/meminfo")
    result = run("topology", "--root", str(tree), "--json")
    assert result.exit_code == 0
    out, err = result.stdout, result.stderr
    data = json.loads(out)
    assert len([c for c in data["cpus"] if c["online"]]) == 64
    assert any("node 2" in w for w in data["warnings"])
    assert "tidal: warning:" in err


def test_no_online_cpu_is_an_error(tree):
    (tree / "sys/devices/system/cpu/online").write_text("200\n")  # a cpu the tree does not have
    result = run("topology", "--root", str(tree))
    assert result.exit_code == 2 and "no cpu is online" in _error_line(result)


def test_an_empty_online_file_is_unknown_not_fatal(tree):
    """#17: an empty attribute is unknown (hwloc reads such trees); the per-cpu files decide."""
    (tree / "sys/devices/system/cpu/online").write_text("\n")
    result = run("topology", "--root", str(tree), "--json")
    assert result.exit_code == 0 and json.loads(result.output.split("\ntidal: warning")[0])["cpus"]


def test_bench_topology_json(tree):
    result = run("bench", "topology", "--root", str(tree), "--repeat", "3", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["cpus"] == 64
    assert data["discovery_ms"] > 0
    assert set(data) >= {"discovery_ms", "lstopo_ms", "cpus"}
    if shutil.which("lstopo-no-graphics") or shutil.which("lstopo"):
        assert data["lstopo_ms"] > 0
    else:
        assert data["lstopo_ms"] is None


def test_discovery_is_deterministic(tree):
    assert discover(HostFS(str(tree))) == discover(HostFS(str(tree)))

"""``tidal topology --capture``: a capture read back gives the reading of the tree it was taken from."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agent.errors import TopologyError
from agent.topology import HostFS, discover
from agent.topology.capture import RecordingFS, write_capture
from agent.topology.synthetic import FakeNic, Shape, write_tree
from tests.conftest import hwloc_cases


def _round_trip(root: str, out: str):
    recording = RecordingFS(root)
    original = discover(recording)
    written = write_capture(recording, out)
    return original, discover(HostFS(out)), written


@pytest.mark.parametrize("name", [name for name, _ in hwloc_cases()])
def test_a_capture_of_each_hwloc_tree_reads_back_the_same(hwloc_trees, tmp_path, name):
    original, again, written = _round_trip(hwloc_trees[name], str(tmp_path / "capture"))
    assert written > 0
    assert again.to_dict() == original.to_dict()


def test_a_capture_keeps_gpus_and_nics_with_their_numa_nodes(tmp_path):
    root = tmp_path / "tree"
    write_tree(str(root), Shape(gpus=(0, 1, 2, 3), nics=(FakeNic("eth0", 0), FakeNic("eth1", 2))))
    original, again, _ = _round_trip(str(root), str(tmp_path / "capture"))
    assert [(g.pci, g.numa) for g in again.gpus] == [(g.pci, g.numa) for g in original.gpus]
    assert len(again.gpus) == 4 and {g.numa for g in again.gpus} == {0, 1, 2, 3}
    assert [(n.name, n.numa, n.pci) for n in again.nics] == [(n.name, n.numa, n.pci) for n in original.nics]
    assert again.to_dict() == original.to_dict()


def test_a_capture_holds_only_what_discovery_read(tmp_path):
    root = tmp_path / "tree"
    write_tree(str(root), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2, threads_per_core=1))
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc" / "secret").write_text("not the topology's\n")
    _round_trip(str(root), str(tmp_path / "capture"))
    assert not (tmp_path / "capture" / "proc" / "secret").exists()


def test_a_capture_into_a_directory_that_holds_something_is_refused(tmp_path):
    out = tmp_path / "capture"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(TopologyError, match="new or empty directory"):
        write_capture(RecordingFS("/"), str(out))
    assert (out / "keep").read_text() == "mine"


def test_the_cli_captures_the_live_host_and_reads_it_back(tmp_path):
    out = str(tmp_path / "capture")
    cli = [sys.executable, "-m", "agent.cli"]
    live = subprocess.run(cli + ["topology", "--json", "--capture", out], capture_output=True, text=True, check=True)
    assert "captured" in live.stderr and os.path.isdir(out + "/sys/devices/system/cpu")
    again = subprocess.run(cli + ["topology", "--json", "--root", out], capture_output=True, text=True, check=True)
    live_doc, again_doc = json.loads(live.stdout), json.loads(again.stdout)
    for doc in (live_doc, again_doc):
        # CPUID (py-cpuinfo) and NVML are not files: a capture has /proc/cpuinfo's model and flags, and
        # the GPUs' place without their model, memory and uuid
        doc.pop("cpu_model", None), doc.pop("cpu_flags", None)
        for gpu in doc.get("gpus", []):
            gpu.pop("model", None), gpu.pop("memory_bytes", None), gpu.pop("uuid", None)
    assert again_doc == live_doc


CAPTURED = os.path.join(os.path.dirname(__file__), "..", "fixtures", "captured")


def test_a_real_gpu_node_read_back_from_its_capture_matches_its_live_reading(tmp_path):
    """The H100 machine lent to this project: discovery of its capture, offline, is the live reading but
    for what NVML and CPUID alone know; the live reading's NVML figures are nvidia-smi's."""
    base = os.path.join(CAPTURED, "h100-vm")
    subprocess.run(["tar", "-xjf", os.path.join(base, "tree.tar.bz2"), "-C", str(tmp_path)], check=True)
    with open(os.path.join(base, "live.json")) as handle:
        live = json.load(handle)
    offline = discover(HostFS(str(tmp_path))).to_dict()
    [gpu] = live["gpus"]
    assert gpu["model"] == "NVIDIA H100 80GB HBM3"
    assert gpu["memory_bytes"] == 81559 << 20  # nvidia-smi's memory.total, 81559 MiB
    assert gpu["uuid"].startswith("GPU-40ece162-") and gpu["pci"] == "0000:00:06.0"
    assert gpu["numa"] == 0  # the function says -1; nvidia-smi topo -m: NUMA affinity 0
    assert [g["numa"] for g in offline["gpus"]] == [0] and offline["gpus"][0]["model"] is None
    assert len(offline["cpus"]) == 16
    for doc in (live, offline):
        doc.pop("cpu_flags", None)
        for g in doc["gpus"]:
            g.pop("model"), g.pop("memory_bytes"), g.pop("uuid")
    assert offline == live

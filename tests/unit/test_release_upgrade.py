"""Releases upgrade in place: a checkpoint written by each released agent is read by this one, and
every workload keeps what it held (its cpus, memory nodes, tier).

The fixtures under tests/fixtures/checkpoints/<release>/ were written by that release's code
(tests/fixtures/checkpoints/write.py, run with the release's tree on the path; 0.1.0 is commit f2b128f).
A change of the checkpoint's format must keep reading every one of them, or the release breaks the
nodes it is rolled onto.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from agent.isolation.cgroups.recording import RecordingCgroups
from agent.topology import HostFS, discover
from agent.topology.synthetic import Shape, write_tree

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints"
sys.path.insert(0, str(FIXTURES))
from write import SHAPE, WORKLOADS  # noqa: E402

RELEASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "checkpoint.json").exists())


def test_every_release_has_a_fixture():
    import re

    released = re.findall(r"^## (\d+\.\d+\.\d+)\s*$", (FIXTURES.parents[2] / "CHANGELOG.md").read_text(), re.M)
    assert released and set(released) <= set(RELEASES), (released, RELEASES)


@pytest.mark.parametrize("release", RELEASES)
def test_this_agent_reads_what_a_released_agent_left_and_keeps_every_workload(tmp_path, release, make_agent):
    write_tree(str(tmp_path / "root"), Shape(**SHAPE))
    topo = discover(HostFS(str(tmp_path / "root")))
    (tmp_path / "state").mkdir(mode=0o700)
    shutil.copy(FIXTURES / release / "checkpoint.json", tmp_path / "state")
    left = {a["name"]: a for a in json.loads((FIXTURES / release / "checkpoint.json").read_text())["data"]["allocations"]}
    assert set(left) == {w["name"] for w in WORKLOADS}
    lines = []
    driver = RecordingCgroups()
    agent = make_agent(topo, driver=driver, echo=lines.append, state="state", memory_reserved_bytes=0)
    try:
        assert not [line for line in lines if "warning" in line], lines  # no checkpoint set aside
        kept = {a.name: a for a in agent.state.allocations}
        assert set(kept) == set(left)
        for name, was in left.items():
            now = kept[name]
            assert (now.qos.value, list(now.cpus), list(now.mems), now.tier.value, now.millicpu) == \
                (was["qos"], was["cpus"], was["mems"], was["tier"], was["millicpu"]), name
        db = next(w for w in agent.workloads() if w["name"] == "db")
        assert db["cpus"] == "1-2,9-10" and db["mems"] == "0"
        assert driver.read("cpuset", "tidal/dedicated/db", "cpuset.cpus") == "1-2,9-10"  # enforced as before
    finally:
        agent.shutdown()

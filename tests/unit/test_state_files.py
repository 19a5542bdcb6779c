"""Every file of the state directory is input: a bad one is kept as .bad-N with one warning, never a traceback.

One agent runs, admits workloads, lends the node and stops; one file is
damaged; a second agent starts from the same state directory and the same
"kernel" (the recording driver, which keeps what the first wrote). It must
start, say one warning naming the file, keep the damaged file aside, recover
what the kernel or a safe default says, and run periods and answer its API
as usual. A FIFO or directory in place of a file is refused with one error.
"""

from __future__ import annotations

import os

import pytest

from agent.daemon import Agent, AgentConfig
from agent.errors import StateError
from agent.isolation.cgroups.driver import RecordingCgroups
from agent.qrm.model import Allocation, QoS
from agent.qrm.policy import State
from agent.qrm.state import encode
from agent.topology.synthetic import Shape, write_tree


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    from agent.topology import HostFS, discover

    root = tmp_path_factory.mktemp("stfiles")
    write_tree(str(root), Shape(sockets=1, numa_per_socket=2, cores_per_numa=2, threads_per_core=1))
    return discover(HostFS(str(root)))


def boot(tmp_path, topo, driver, lines):
    agent = Agent(AgentConfig(state_dir=str(tmp_path / "state"), socket_path=str(tmp_path / "t.sock"),
                              reserved_cpus=(0,)), echo=lines.append, driver=driver, topology=topo)
    agent.start()
    return agent


def first_run(tmp_path, topo):
    """Workloads with processes, a lent node, a history and saved originals: every file written."""
    driver = RecordingCgroups()
    driver.create("kubepods")
    driver.write("cpuset", "kubepods", "cpuset.cpus", "0-3")
    agent = boot(tmp_path, topo, driver, [])
    agent.admit({"name": "db", "qos": "dedicated_cores", "cpus": 1})
    agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 100})
    agent.admit({"name": "pod", "qos": "shared_cores", "millicpu": 100}, source="kubernetes")
    agent.place("pod", ("kubepods",))  # writes into a cgroup Tidal did not make: originals.json
    agent.attach("db", 4242)
    agent.tick()
    agent.lend("1h")
    agent.harvest.estimator.history.save()
    agent.shutdown()
    for name in ("checkpoint.json", "node.json", "history.json", "originals.json"):
        assert (tmp_path / "state" / name).is_file(), name
    return driver


def crafted_checkpoint(topo, allocations):
    """A checkpoint whose checksum is valid and whose content is not."""
    return encode(State(reserved=(0,), allocations=tuple(allocations)), topo)


CASES = [
    # file, content (bytes, or a callable of the topology), what the second agent shows
    ("checkpoint.json", b"[]", "recovered"),
    ("checkpoint.json", b'{"version": 1, "da', "recovered"),
    ("checkpoint.json", b"\x00\xff\xfe binary", "recovered"),
    ("checkpoint.json", None, "recovered"),  # deleted: rebuilt from the kernel, not dropped
    ("checkpoint.json", lambda topo: crafted_checkpoint(topo, [
        Allocation("a", QoS.DEDICATED, 1000, cpus=(1,), mems=(0,)),
        Allocation("b", QoS.DEDICATED, 1000, cpus=(1,), mems=(0,))]), "recovered"),  # one cpu, two owners
    ("checkpoint.json", lambda topo: crafted_checkpoint(topo, [
        Allocation("../../../escape", QoS.SHARED, 100, mems=(0,))]), "recovered"),
    ("checkpoint.json", lambda topo: crafted_checkpoint(topo, [
        Allocation("x", QoS.DEDICATED, 1000, cpus=(99,), mems=(0,))]), "recovered"),  # a cpu this node lacks
    ("node.json", b"[]", "lent"),
    ("node.json", b'{"state": "Offline", "deadline": "soon"}', "lent"),
    ("node.json", b'{"state": "Offl', "lent"),  # truncated: a lent node stays lent
    ("node.json", b'{"state": "Online", "since": 1e999}', "lent"),
    ("history.json", b"[]", "history"),
    ("history.json", b'{"hours": []}', "history"),
    ("history.json", b'{"hours": {"2026-01-01T00": [1e999, 1]}}', "history"),
    ("originals.json", b"[]", "originals"),
    ("originals.json", b'{"originals": [["a", "b"]]}', "originals"),
]


@pytest.mark.parametrize("name, content, outcome", CASES, ids=[
    "cp-list", "cp-truncated", "cp-binary", "cp-deleted", "cp-checksummed-overlap", "cp-checksummed-escape",
    "cp-checksummed-foreign-cpu", "node-list", "node-deadline-word", "node-truncated", "node-infinite",
    "history-list", "history-hours-list", "history-infinite", "originals-list", "originals-short-row"])
def test_a_damaged_state_file_is_kept_aside_and_the_agent_carries_on(tmp_path, topo, name, content, outcome):
    driver = first_run(tmp_path, topo)
    path = tmp_path / "state" / name
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content(topo) if callable(content) else content)
    lines = []
    agent = boot(tmp_path, topo, driver, lines)
    try:
        warnings = [line for line in lines if "warning" in line]
        assert len(warnings) == 1 and name in warnings[0], lines
        if content is not None:
            assert (tmp_path / "state" / f"{name}.bad-0").read_bytes() == (
                content(topo) if callable(content) else content)
        names = set(agent.state.names())
        if outcome == "recovered":
            # the kernel's tree says what ran: the local workloads are back (the pod's source relists it)
            assert {"db", "batch"} <= names and "../../../escape" not in names
            from agent.topology.parse import format_cpulist

            assert format_cpulist(agent.state.get("db").cpus) == driver.files["tidal/dedicated/db"][
                ("cpuset", "cpuset.cpus")]  # the cpus its processes run on, as the kernel shows them
            assert not any(p.startswith("..") or "/../" in p for p in driver.files)  # nothing outside the tree
        else:
            assert names == {"db", "batch", "pod"}
        if outcome == "lent":
            assert agent.lending.current.state == "Offline"
        else:
            assert agent.lending.current.state == "OnlineToOffline"
        dedicated = [set(a.cpus) for a in agent.state.allocations if a.qos is QoS.DEDICATED]
        assert sum(len(c) for c in dedicated) == len(set().union(*dedicated))  # no cpu with two owners
        agent.tick()  # a period runs
        assert agent.node_doc()["state"] and agent.capacity_doc()["reclaimed"] is not None
        assert agent.status()["workloads"] == len(agent.state.allocations)
    finally:
        agent.shutdown()


@pytest.mark.parametrize("name", ["checkpoint.json", "node.json", "history.json", "originals.json"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_state_file_that_is_not_a_regular_file_is_refused_with_one_error(tmp_path, topo, name, kind):
    driver = first_run(tmp_path, topo)
    path = tmp_path / "state" / name
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(StateError, match=f"{name}.*not a regular file"):
        boot(tmp_path, topo, driver, [])  # returns at once: a FIFO is never read (it would block)


def test_the_agent_as_a_process_says_one_error_line_for_a_fifo_checkpoint(tmp_path):
    import subprocess
    import sys

    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    (tmp_path / "state").mkdir()
    os.mkfifo(tmp_path / "state" / "checkpoint.json")
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                           "--record-cgroups", "--socket", str(tmp_path / "t.sock"), "--state-dir",
                           str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("tidal: error:") and "not a regular file" in errors[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout

"""Every file of the state directory is input: a bad one is kept as .bad-N with one warning, never a traceback.

One agent runs, admits workloads, lends the node and stops; one file is
damaged; a second agent starts from the same state directory and the same
"kernel" (the recording driver, which keeps what the first wrote). It must
start, say one warning naming the file, keep the damaged file aside, recover
what the kernel or a safe default says, and run periods and answer its API
as usual. A FIFO or directory in place of a file is kept aside the same way
(it once stopped the agent: a local user who could plant one decided the next
start); a state directory others may write is refused with one error line.
"""

from __future__ import annotations

import os

import pytest

from agent.isolation.cgroups.recording import RecordingCgroups
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


def boot(make_agent, topo, driver, lines):
    """An agent on the state directory ``state`` (each boot of a test is a restart of the one before)."""
    return make_agent(topo, driver=driver, echo=lines.append, state="state", reserved_cpus=(0,))


def first_run(tmp_path, topo, make_agent):
    """Workloads with processes, a lent node, a history and saved originals: every file written."""
    driver = RecordingCgroups()
    driver.create("kubepods")
    driver.write("cpuset", "kubepods", "cpuset.cpus", "0-3")
    agent = boot(make_agent, topo, driver, [])
    agent.admit({"name": "db", "qos": "dedicated_cores", "cpus": 1})
    agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 100})
    agent.admit({"name": "pod/u1", "qos": "shared_cores", "millicpu": 100}, source="kubernetes")
    agent.place("pod/u1", ("kubepods",))  # writes into a cgroup Tidal did not make: originals.json
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
    ("checkpoint.json", b'{"version": 1, "data": {"reserved": [' + b"9" * 5000 + b"]}}", "recovered"),
    ("checkpoint.json", b"[" * 200_000, "recovered"),  # these two once stopped the agent's start
    ("node.json", b"[]", "lent"),
    ("node.json", b'{"state": "Offline", "deadline": "soon"}', "lent"),
    ("node.json", b'{"state": "Offl', "lent"),  # truncated: a lent node stays lent
    ("node.json", b'{"state": "Online", "since": 1e999}', "lent"),
    ("history.json", b"[]", "history"),
    ("history.json", b'{"hours": []}', "history"),
    ("history.json", b'{"hours": {"2026-01-01T00": [1e999, 1]}}', "history"),
    ("history.json", b"{" * 100_000, "history"),
    ("originals.json", b"[]", "originals"),
    ("originals.json", b'{"originals": [["a", "b"]]}', "originals"),
]


@pytest.mark.parametrize("name, content, outcome", CASES, ids=[
    "cp-list", "cp-truncated", "cp-binary", "cp-deleted", "cp-checksummed-overlap", "cp-checksummed-escape",
    "cp-checksummed-foreign-cpu", "cp-5000-digits", "cp-nested", "node-list", "node-deadline-word", "node-truncated", "node-infinite",
    "history-list", "history-hours-list", "history-infinite", "history-nested", "originals-list", "originals-short-row"])
def test_a_damaged_state_file_is_kept_aside_and_the_agent_carries_on(tmp_path, topo, name, content, outcome, make_agent):
    driver = first_run(tmp_path, topo, make_agent)
    path = tmp_path / "state" / name
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content(topo) if callable(content) else content)
    lines = []
    agent = boot(make_agent, topo, driver, lines)
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
            assert names == {"db", "batch", "pod/u1"}
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
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_state_file_that_is_not_a_regular_file_is_kept_aside_and_the_agent_starts(tmp_path, topo, name, kind, make_agent):
    driver = first_run(tmp_path, topo, make_agent)
    path = tmp_path / "state" / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # never read: it would block the start
    elif kind == "directory":
        path.mkdir()
        (path / "planted").write_text("x")
    else:
        path.symlink_to("/etc/shadow")
    lines = []
    agent = boot(make_agent, topo, driver, lines)
    try:
        warnings = [line for line in lines if "warning" in line]
        assert len(warnings) == 1 and name in warnings[0] and "not a regular file" in warnings[0], lines
        kept = tmp_path / "state" / f"{name}.bad-0"
        assert os.path.lexists(kept) and not os.path.lexists(path) or name in ("checkpoint.json", "node.json")
        if name == "checkpoint.json":
            assert {"db", "batch"} <= set(agent.state.names())  # rebuilt from the kernel
        if name == "node.json":
            assert agent.lending.current.state == "Offline"  # unknown: a lent node stays lent
        agent.tick()
    finally:
        agent.shutdown()
    assert os.path.lexists(kept) and (kept.is_symlink() or not kept.is_file())  # kept as it was, for the operator


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_state_directory_others_may_write_is_refused_with_one_line(tmp_path, mode):
    import subprocess
    import sys

    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    (tmp_path / "state").mkdir()
    os.chmod(tmp_path / "state", mode)
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                           "--cgroups-in-memory", "--socket", str(tmp_path / "t.sock"), "--state-dir",
                           str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("tidal: error:") and "writable by others" in errors[0], \
        done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert os.listdir(tmp_path / "state") == []  # nothing read, nothing written


def test_the_agent_as_a_process_keeps_a_fifo_checkpoint_aside_and_serves(tmp_path):
    import subprocess
    import sys

    from agent.client import AgentClient

    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    (tmp_path / "state").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "state" / "checkpoint.json")
    sock = str(tmp_path / "t.sock")
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                              "--cgroups-in-memory", "--socket", sock, "--state-dir", str(tmp_path / "state")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import time

        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert agent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert AgentClient(sock).request("GET", "/v1/workloads") == {"workloads": []}
        assert os.path.exists(tmp_path / "state" / "checkpoint.json.bad-0")
    finally:
        agent.terminate()
        out = agent.communicate(timeout=30)[0]
    assert "not a regular file" in out and "Traceback" not in out, out

"""--confine-host-cgroups on a host without systemd, against the real kernel (v1 here, v2 in make test-cgroup2):
the agent as shipped (its defaults: the reserved pool is the first physical core) holds a cgroup of the
host's own work, and a child of it, on the reserved cpus; someone widening it is put back; --revert gives
the host its values back. A path that is not there: one line, exit 2, nothing made."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from agent.client import AgentClient
from agent.isolation.cgroups.detect import detect
from agent.isolation.cgroups.driver import KernelCgroups
from agent.topology import HostFS
from agent.topology.parse import parse_cpulist
from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]


def allowed(pid: int) -> set:
    with open(f"/proc/{pid}/status") as handle:
        line = next(line for line in handle if line.startswith("Cpus_allowed_list:"))
    return set(parse_cpulist(line.split(":", 1)[1].strip()))


@pytest.fixture
def host_cgroup():
    """A cgroup of the host's own work at the root, with a child holding a process (made as a host's
    init scripts would: v1's cpuset given its parent's cpus and mems, v2's inheriting them)."""
    if os.path.isdir("/run/systemd/system"):
        pytest.skip("systemd runs this host: it owns the cgroups (tests/systemd covers --confine-host-units)")
    driver = KernelCgroups(detect(HostFS("/")))
    name = f"tidal-test-host-{uuid.uuid4().hex[:8]}"
    made, proc = [], None
    if driver.version == 2:  # a host that uses cpusets: the root hands the controller down (the agent would too)
        driver.write("", "", "cgroup.subtree_control", "+cpuset")
    try:
        for path in (name, f"{name}/svc"):
            driver.create(path)
            made.append(path)
            if driver.version == 1:
                parent = path.rsplit("/", 1)[0] if "/" in path else ""
                for file in ("cpuset.cpus", "cpuset.mems"):
                    driver.write("cpuset", path, file, driver.read("cpuset", parent, file).strip())
        proc = subprocess.Popen(["sleep", "300"])
        driver.move(f"{name}/svc", proc.pid)
        yield driver, name, proc
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        for path in reversed(made):
            for _ in range(50):
                try:
                    driver.remove(path)
                    break
                except Exception:
                    time.sleep(0.1)


def start(tmp_path, args):
    sock = tmp_path / "a.sock"
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--socket", str(sock), "--state-dir",
                             str(tmp_path / "state"), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60  # Python alone takes ~10 s to start in the emulated cgroup v2 VM
    while not os.path.exists(sock):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the agent did not start"
        time.sleep(0.05)
    return proc, AgentClient(str(sock))


def test_a_host_cgroup_is_held_on_the_reserved_cpus_repaired_and_given_back(tmp_path, host_cgroup):
    driver, name, sleeper = host_cgroup
    every = allowed(sleeper.pid)
    if len(every) < 2:
        pytest.skip("one cpu: the reserved pool is every cpu")
    before = {p: driver.read("cpuset" if driver.version == 1 else "", p, "cpuset.cpus")
              for p in (name, f"{name}/svc")}
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    # as shipped but for a unique tree, state and socket
    agent, client = start(tmp_path, ["--cgroup-base", base, "--revert", "--confine-host-cgroups", f"/{name}"])
    try:
        status = client.request("GET", "/v1/status")
        reserved = set(parse_cpulist(status["pools"]["reserved"]))
        assert reserved and reserved < every
        held = status["host_cgroups"]
        expect = [name, f"{name}/svc"] if driver.version == 1 else [name]
        assert held["named"] == [name] and held["held"] == expect and not held["missing"]
        assert set(parse_cpulist(held["cpus"])) == reserved
        assert allowed(sleeper.pid) == reserved  # the host's process runs on the reserved cpus only
        # someone (an init script) widens it again: held again at the next pass that reads it (others'
        # cgroups are read whenever the tree is reconciled; the drift check, every 30 s, at the latest)
        controller = "cpuset" if driver.version == 1 else ""
        widen = ",".join(str(c) for c in sorted(every))
        driver.write(controller, name, "cpuset.cpus", widen)
        if driver.version == 1:
            driver.write(controller, f"{name}/svc", "cpuset.cpus", widen)
        deadline = time.monotonic() + 60
        while allowed(sleeper.pid) != reserved:
            assert time.monotonic() < deadline, "the widened host cgroup was not held again"
            time.sleep(0.2)
        assert set(parse_cpulist(driver.read(controller, name, "cpuset.cpus").strip())) == reserved
    finally:
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=60)
    assert agent.returncode == 0, out
    # --revert: the host's values back, every cpu for its process, Tidal's tree gone
    after = {p: driver.read(controller, p, "cpuset.cpus") for p in (name, f"{name}/svc")}
    # v2 keeps a populated cgroup's cpuset from going empty (ENOSPC), so one that was "as the parent"
    # gets the parent's effective set back: what empty gave its processes (Reconciler._restore_inherited)
    inherited = driver.read(controller, "", "cpuset.cpus.effective").strip() if driver.version == 2 else None
    for path, text in before.items():
        assert after[path].strip() in ({text.strip()} | ({inherited} if not text.strip() else set())), (path, out)
    assert allowed(sleeper.pid) == every
    assert not driver.exists(base)


def test_a_host_cgroup_that_is_not_there_is_one_line_and_nothing_made(tmp_path):
    if os.path.isdir("/run/systemd/system"):
        pytest.skip("systemd runs this host: the refusal is that one (tests/unit)")
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--socket", str(tmp_path / "s.sock"),
                           "--state-dir", str(tmp_path / "st"), "--cgroup-base", base,
                           "--confine-host-cgroups", "/tidal-test-no-such-cgroup"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "tidal-test-no-such-cgroup: no such cgroup" in lines[0], done.stderr
    driver = KernelCgroups(detect(HostFS("/")))
    assert not driver.exists(base)
    assert not os.path.exists(tmp_path / "st" / "checkpoint.json")

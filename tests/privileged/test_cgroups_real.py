"""Real cgroups on this machine (root only): confinement, resizing, crash, drift, revert.

Each test builds its own tree, ``tidal-test-<random>``, under the test
process's own cgroup in every hierarchy, and removes it afterwards.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from agent.client import AgentClient
from agent.daemon import Agent, AgentConfig
from agent.isolation.cgroups.detect import detect
from agent.isolation.cgroups.driver import KernelCgroups
from agent.isolation.cgroups.reconcile import Reconciler
from agent.isolation.cgroups.recover import recover_state
from agent.topology import HostFS, discover
from agent.topology.parse import parse_cpulist
from tests.conftest import cpuset_dir, privileged

pytestmark = [pytest.mark.privileged, privileged]

TOPO = discover(HostFS("/"), use_cpuinfo_lib=False)
needs_two_cpus = pytest.mark.skipif(len(TOPO.online_cpus()) < 2, reason="needs at least 2 online cpus")


def allowed(pid: int, field: str = "Cpus_allowed_list") -> set:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return set(parse_cpulist(line.split(":", 1)[1]))
    raise AssertionError(f"no {field} for {pid}")


def last_cpu(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[36])


@pytest.fixture()
def base():
    name = f"tidal-test-{uuid.uuid4().hex[:8]}"
    yield name
    driver = KernelCgroups(detect(HostFS("/")), parent="self")
    report = Reconciler(driver, name).revert()
    assert not driver.exists(name), report.failed


@pytest.fixture()
def procs():
    started = []

    def spawn(*cmd):
        proc = subprocess.Popen(list(cmd) or ["sleep", "60"])
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture()
def agent(tmp_path, base):
    config = AgentConfig(api_poll_interval=0.05, socket_path=str(tmp_path / "a.sock"), state_dir=str(tmp_path / "state"),
                         reserved_cpus=(), cgroup_base=base, cgroup_parent="self", empty_grace=3600, resize=False,
                         drift_check_period=0, watch_period=0)
    agent = Agent(config, echo=lambda line: None)
    agent.start()
    yield agent
    agent.shutdown()


HOG = [sys.executable, "-c", "while True: pass"]


@needs_two_cpus
def test_dedicated_process_has_exactly_its_cpus(agent, procs):
    workload = agent.admit({"name": "web", "qos": "dedicated_cores", "cpus": 1})
    sleeper = procs()
    agent.attach("web", sleeper.pid)
    want = set(agent.state.get("web").cpus)
    assert allowed(sleeper.pid) == want == set(parse_cpulist(workload["cpus"]))
    assert allowed(sleeper.pid, "Mems_allowed_list") == set(agent.state.get("web").mems)


@needs_two_cpus
def test_reclaimed_never_runs_on_dedicated_cpus(agent, procs):
    agent.admit({"name": "web", "qos": "dedicated_cores", "cpus": 1})
    agent.admit({"name": "hog", "qos": "reclaimed_cores", "millicpu": 1000})
    hogs = [procs(*HOG) for _ in range(2)]
    for hog in hogs:
        agent.attach("hog", hog.pid)
    dedicated = set(agent.state.get("web").cpus)
    for hog in hogs:
        assert not allowed(hog.pid) & dedicated
    seen = set()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        for hog in hogs:
            seen.add(last_cpu(hog.pid))
        time.sleep(0.01)
    assert seen and not seen & dedicated


@needs_two_cpus
def test_pool_resizing_moves_cpus_while_processes_run(tmp_path, base, procs):
    from agent.isolation.cgroups.desired import CgroupOptions

    config = AgentConfig(api_poll_interval=0.05, socket_path=str(tmp_path / "r.sock"), state_dir=str(tmp_path / "st"), reserved_cpus=(),
                         cgroup_base=base, cgroup_parent="self", empty_grace=3600, resize=False,
                         cgroup_options=CgroupOptions(harvest_shared=False))
    agent = Agent(config, echo=lambda line: None)
    agent.start()
    try:
        agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 500})
        agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 500})
        online, offline = procs(), procs(*HOG)
        agent.attach("web", online.pid)
        agent.attach("batch", offline.pid)
        cpus = set(TOPO.online_cpus())
        shared_before, reclaimed_before = allowed(online.pid), allowed(offline.pid)
        assert not shared_before & reclaimed_before and shared_before | reclaimed_before == cpus
        # online needs more: lend nothing
        agent.owner.commit(agent.state.with_reclaim_cpus(0))
        report = agent.reconcile()
        assert report.ok, report.failed
        assert allowed(online.pid) == cpus  # the shared pool took every cpu back
        assert offline.poll() is None  # offline kept running (parked on a throttled cpu)
        # and lend again
        agent.owner.commit(agent.state.with_reclaim_cpus(None))
        assert agent.reconcile().ok
        assert allowed(online.pid) == shared_before and allowed(offline.pid) == reclaimed_before
    finally:
        agent.shutdown()


@needs_two_cpus
def test_drift_made_by_someone_else_is_repaired(agent, procs):
    agent.admit({"name": "web", "qos": "dedicated_cores", "cpus": 1})
    sleeper = procs()
    agent.attach("web", sleeper.pid)
    everything = ",".join(map(str, TOPO.online_cpus()))
    base = agent.config.cgroup_base
    drifted = 0
    if agent.driver.version == 2 and agent.driver.features.get("partition"):
        # a partition bounds its cpus by cpuset.cpus.exclusive: someone must undo the partition first
        with open(os.path.join(cpuset_dir(agent.driver, f"{base}/dedicated/web"), "cpuset.cpus.partition"), "w") as f:
            f.write("member")
        drifted += 1
    for path in ("dedicated", "dedicated/web"):  # parent first, as v1 demands
        with open(os.path.join(cpuset_dir(agent.driver, f"{base}/{path}"), "cpuset.cpus"), "w") as handle:
            handle.write(everything)
        drifted += 1
    assert allowed(sleeper.pid) == set(TOPO.online_cpus())
    agent.tick()
    assert allowed(sleeper.pid) == set(agent.state.get("web").cpus)
    assert agent.counters["drift_repairs"] == drifted


def cgroup2_of(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as handle:
        return next(line.split(":", 2)[2].strip() for line in handle if line.startswith("0::"))


def test_attached_process_is_in_the_cgroup2_membership_tree_too(agent, procs):
    """The network classifier matches a socket's cgroup2 cgroup: on a hybrid host the
    workload must be a member of the mirror as well as of its v1 cgroups."""
    mirror = agent.driver.membership_dir(f"{agent.config.cgroup_base}/reclaimed/low/batch")
    if mirror is None:
        pytest.skip("this host has no cgroup2 hierarchy (v1 only): nothing to mirror into")
    agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"})
    sleeper = procs()
    agent.attach("batch", sleeper.pid)
    unified_root = detect(HostFS("/")).unified
    assert cgroup2_of(sleeper.pid) == "/" + os.path.relpath(mirror, unified_root)
    assert str(sleeper.pid) in open(os.path.join(mirror, "cgroup.procs")).read().split()


def test_attach_of_a_dead_pid_is_a_clear_error(agent):
    from agent.errors import AdmissionError

    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 100})
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(AdmissionError, match="no such process"):
        agent.attach("web", dead.pid)


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [part.decode() for part in f.read().split(b"\0") if part]


def _start_agent(tmp_path, base, extra=()):
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "agent", "--socket", str(tmp_path / "k.sock"), "--state-dir",
         str(tmp_path / "kstate"), "--reserved-cpus", "none", "--cgroup-base", base, "--cgroup-parent", "self",
         "--period", "0.2", "--no-resize", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60  # Python alone takes ~10 s to start in the emulated cgroup v2 VM
    while not os.path.exists(tmp_path / "k.sock"):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "agent did not start"
        time.sleep(0.05)
    return proc


@needs_two_cpus
def test_sigkill_of_the_agent_keeps_workloads_confined(tmp_path, base):
    agent = _start_agent(tmp_path, base)
    client = AgentClient(str(tmp_path / "k.sock"))
    runner = subprocess.Popen([sys.executable, "-m", "agent.cli", "run", "--socket", str(tmp_path / "k.sock"),
                               "--qos", "dedicated_cores", "--cpus", "1", "--name", "web", "--", "sleep", "60"])
    try:
        deadline = time.monotonic() + 20
        while True:
            workloads = client.request("GET", "/v1/workloads")["workloads"]
            # wait for the exec, not only the attach: a SIGKILL between the two would take the
            # attach's answer with it, and `tidal run` cannot know whether it was attached
            if workloads and workloads[0]["pids"] and _cmdline(runner.pid)[:1] == ["sleep"]:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cpus = set(parse_cpulist(workloads[0]["cpus"]))
        assert allowed(runner.pid) == cpus  # tidal run became `sleep` in the workload's cgroup
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        time.sleep(0.5)
        assert runner.poll() is None and allowed(runner.pid) == cpus  # still running, still confined
        os.unlink(tmp_path / "k.sock")  # a SIGKILLed agent leaves its socket; a restart must cope either way
        agent = _start_agent(tmp_path, base)
        workloads = client.request("GET", "/v1/workloads")["workloads"]
        assert [(w["name"], set(parse_cpulist(w["cpus"])), w["pids"]) for w in workloads] == [
            ("web", cpus, [runner.pid])]
        driver = KernelCgroups(detect(HostFS("/")), parent="self")
        kernel = recover_state(driver, base, TOPO, reserved=())  # the agent runs with --reserved-cpus none
        state = json.loads((tmp_path / "kstate" / "checkpoint.json").read_text())["data"]
        assert [(a.name, list(a.cpus)) for a in kernel.allocations] == [
            (a["name"], a["cpus"]) for a in state["allocations"]]
    finally:
        runner.kill()
        runner.wait()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=20)


def test_revert_on_exit_leaves_no_trace(tmp_path, base):
    driver = KernelCgroups(detect(HostFS("/")), parent="self")
    agent = _start_agent(tmp_path, base, ["--revert"])
    client = AgentClient(str(tmp_path / "k.sock"))
    client.request("POST", "/v1/workloads", {"name": "x", "qos": "shared_cores", "millicpu": 100})
    assert driver.exists(f"{base}/shared/x")
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=20)
    assert agent.returncode == 0 and "reverted" in out
    for directory in driver.where(base).values():
        assert not os.path.exists(directory)
    mirror = driver.membership_dir(base)
    assert mirror is None or not os.path.exists(mirror)


@privileged
def test_a_release_after_someone_else_moved_the_process_removes_every_trace(agent, base, procs):
    """#17: a release after the workload's process was moved by someone else left cgroups behind and
    answered 200. v1: moved out of the cpuset hierarchy only (the cpu, cpuacct, memory and cgroup2 twins
    stayed). v2 has one hierarchy; there the process was moved into a cgroup the workload's own tooling
    made below its leaf (a nested cgroup Tidal never made)."""
    driver = agent.driver
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 100})
    proc = procs()
    agent.attach("web", proc.pid)
    path = f"{base}/shared/web"
    if driver.version == 1:
        with open(f"{driver.bases['cpuset']}/cgroup.procs", "w") as handle:
            handle.write(str(proc.pid))
        assert proc.pid not in driver.procs(path) and proc.pid in driver.procs_anywhere(path)
    else:
        inner = os.path.join(cpuset_dir(driver, path), "inner")
        os.mkdir(inner)
        with open(os.path.join(inner, "cgroup.procs"), "w") as handle:
            handle.write(str(proc.pid))
        assert proc.pid not in driver.procs(path) and driver.children(path) == ["inner"]
    agent.release("web")
    assert not any(os.path.isdir(d) for d in driver.where(path).values())
    assert all(not os.path.isdir(driver._dir(c, path)) for c in driver._distinct)  # the cgroup2 mirror too
    assert proc.poll() is None  # moved out, not killed
    assert cgroup2_of(proc.pid) != "/" + path


@privileged
def test_a_cgroup_left_half_made_is_made_whole(agent, base, procs):
    """v1 (#17): a SIGKILL mid-attach left a process in the workload's cpuset but not its cpu cgroup;
    the next verify pass moves it in every hierarchy. v2: membership is one write, but a cgroup is only
    whole with its controllers: ``-cpuset`` in the parent's subtree_control takes the workload's cpuset
    files away (its processes run anywhere); the next verify pass enables it again and rewrites them."""
    driver = agent.driver
    agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 100})
    path = f"{base}/reclaimed/low/batch"
    proc = procs()
    if driver.version == 1:
        with open(f"{driver._dir('cpuset', path)}/cgroup.procs", "w") as handle:  # the first hierarchy only
            handle.write(str(proc.pid))
        assert proc.pid not in [int(p) for p in open(f"{driver._dir('cpu', path)}/cgroup.procs").read().split()]
        report = agent.reconcile(verify=True)
        assert (path, proc.pid) in report.rejoined
        for controller in driver._distinct:
            assert proc.pid in [int(p) for p in open(f"{driver._dir(controller, path)}/cgroup.procs").read().split()]
    else:
        agent.attach("batch", proc.pid)
        want = allowed(proc.pid)
        parent = os.path.dirname(cpuset_dir(driver, path))
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as handle:
            handle.write("-cpuset")
        assert not os.path.exists(os.path.join(cpuset_dir(driver, path), "cpuset.cpus"))
        report = agent.reconcile(verify=True)
        assert f"{parent}:cpuset" in report.reenabled and report.ok, report.failed
        assert open(os.path.join(cpuset_dir(driver, path), "cpuset.cpus")).read().strip()
        assert allowed(proc.pid) == want


@privileged
@pytest.mark.parametrize("bad", ["", "/", "/tidal", ".", "..", "a/../..", "tidal/", "t idal"],
                         ids=["empty", "root", "absolute", "dot", "dotdot", "escape", "trailing-slash", "space"])
def test_a_cgroup_base_that_is_not_a_tree_of_its_own_is_refused(tmp_path, bad):
    """#17: ``--cgroup-base ''`` with ``--revert`` removed cgroups Tidal never made."""
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--socket", str(tmp_path / "s.sock"),
                           "--state-dir", str(tmp_path / "st"), "--cgroup-base", bad, "--revert"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "must be a relative path of names" in lines[0], done.stderr


@needs_two_cpus
def test_narrowing_a_cpuset_narrows_children_tidal_was_not_told_of(base, procs):
    """A kubelet pod's cgroup has children the agent never placed (the sandbox's): v1 refuses to
    narrow a parent past a child (EBUSY), so the driver narrows the children first. Found by the
    node tier: every write of a pod's cpus failed, once a second, for as long as the pod ran. v2
    narrows a parent whatever its children hold, and the children's effective cpus follow: the same
    write, the same outcome for the processes."""
    driver = KernelCgroups(detect(HostFS("/")), parent="self")
    cpus = sorted(TOPO.online_cpus())
    every, last = f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0]), str(cpus[-1])
    driver.create(base)
    driver.write("cpuset", base, "cpuset.cpus", every)
    driver.write("cpuset", base, "cpuset.mems", "0")
    for child in ("sandbox", "sandbox/deeper", "container"):
        driver.create(f"{base}/{child}")
        driver.write("cpuset", f"{base}/{child}", "cpuset.mems", "0")
        driver.write("cpuset", f"{base}/{child}", "cpuset.cpus", every)
    driver.write("cpuset", f"{base}/container", "cpuset.cpus", last)  # already inside: left alone
    sleeper = procs()
    driver.move(f"{base}/sandbox/deeper", sleeper.pid)

    driver.write("cpuset", base, "cpuset.cpus", last)

    shown = "cpuset.cpus" if driver.version == 1 else "cpuset.cpus.effective"
    for path in (base, f"{base}/sandbox", f"{base}/sandbox/deeper", f"{base}/container"):
        assert parse_cpulist(driver.read("cpuset", path, shown).strip()) == (cpus[-1],), path
    assert allowed(sleeper.pid) == {cpus[-1]}
    sleeper.kill()
    sleeper.wait()
    for child in ("sandbox/deeper", "sandbox", "container"):
        driver.remove(f"{base}/{child}")

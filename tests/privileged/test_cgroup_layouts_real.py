"""Where Tidal's tree and the kubelet's live, on real cgroups of both versions (root only).

Run on this host's v1 and, by ``make test-cgroup2``, on a pure v2 kernel in a VM:

* a delegated subtree (a systemd unit's cgroup with ``Delegate=yes``, the agent started inside it with
  ``--cgroup-parent self``): v2's "no internal processes" rule holds, the agent ends in
  ``<base>/system`` and a revert gives the unit's cgroup back as found;
* a systemd unit's cgroup that is not delegated, or a parent without the cpuset controller: one
  error line, nothing made (v2; v1 has neither rule);
* the kubelet's layouts (cgroupfs and systemd drivers): a pod's cpuset written into the kubelet's
  pod and container cgroups, never creating or removing them;
* dedicated cores as a cpuset partition, or the stated fallback;
* PSI per cgroup through the driver.
"""

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
from agent.topology import HostFS, discover
from agent.topology.parse import parse_cpulist
from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]

MOUNTS = detect(HostFS("/")) if os.path.isdir("/sys/fs/cgroup") else None
V2 = MOUNTS is not None and MOUNTS.version == 2
TOPO = discover(HostFS("/"), use_cpuinfo_lib=False)
needs_two_cpus = pytest.mark.skipif(len(TOPO.online_cpus()) < 2, reason="needs at least 2 online cpus")
v2_rule = pytest.mark.skipif(not V2, reason="a cgroup v2 rule (v1 has no delegation check or subtree_control): "
                                            "runs in `make test-cgroup2`")


def cgroup_of(pid: int) -> str:
    """The process's cgroup where its cpuset is: v2's one path, v1's cpuset hierarchy."""
    with open(f"/proc/{pid}/cgroup") as handle:
        lines = [line.rstrip("\n").split(":", 2) for line in handle]
    for _, controllers, path in lines:
        if (V2 and controllers == "") or (not V2 and "cpuset" in controllers.split(",")):
            return path
    raise AssertionError(f"no cgroup for {pid}")


def allowed(pid: int) -> set:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("Cpus_allowed_list:"):
                return set(parse_cpulist(line.split(":", 1)[1]))
    raise AssertionError(pid)


class Outside:
    """Cgroups made as someone else (systemd, the kubelet) would, at the root of each hierarchy."""

    def __init__(self):
        self.driver = KernelCgroups(MOUNTS, parent="/", mirror_unified=False)
        self.made = []

    def make(self, path: str, controllers=("cpuset", "cpu", "memory")) -> None:
        """Each level made below its parent; v2: the root hands every controller down, deeper levels
        ``controllers`` (as a slice that does not delegate cpuset would)."""
        parts = path.split("/")
        for depth in range(1, len(parts) + 1):
            sub = "/".join(parts[:depth])
            if self.driver.exists(sub):
                continue
            if V2:
                parent = self.driver._dir("", "/".join(parts[:depth - 1]))
                for controller in (("cpuset", "cpu", "memory") if depth == 1 else controllers):
                    with open(os.path.join(parent, "cgroup.subtree_control"), "w") as handle:
                        handle.write(f"+{controller}")
                os.mkdir(self.driver._dir("", sub))
            else:
                self.driver.create(sub)
                for file in ("cpuset.cpus", "cpuset.mems"):  # a v1 cpuset takes no process until set
                    with open(os.path.join(self.driver._dir("cpuset", sub), file), "w") as handle:
                        handle.write(open(os.path.join(self.driver.bases["cpuset"], file)).read().strip())
            self.made.append(sub)

    def dir(self, path: str) -> str:
        return self.driver._dir("" if V2 else "cpuset", path)

    def enter(self, path: str, pid: int) -> None:
        for controller in self.driver._distinct:
            with open(os.path.join(self.driver._dir(controller, path), "cgroup.procs"), "w") as handle:
                handle.write(str(pid))

    def cleanup(self) -> None:
        for path in reversed(self.made):
            for pid in self.driver.procs_anywhere(path):
                try:
                    self.driver.move("", pid)
                except Exception:  # noqa: BLE001 - exited
                    pass
            for child in reversed(_walk(self.driver, path)):
                _rmdir_all(self.driver, child)
            _rmdir_all(self.driver, path)


def _walk(driver, path):
    found = []
    for child in driver.children(path):
        found.append(f"{path}/{child}")
        found += _walk(driver, f"{path}/{child}")
    return found


def _rmdir_all(driver, path):
    for controller in driver._distinct:
        try:
            os.rmdir(driver._dir(controller, path))
        except FileNotFoundError:
            pass


@pytest.fixture()
def outside():
    made = Outside()
    yield made
    made.cleanup()


@pytest.fixture()
def procs():
    started = []

    def spawn():
        proc = subprocess.Popen(["sleep", "120"])
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        proc.kill()
        proc.wait()


def start_agent(tmp_path, args, enter_dirs=()):
    """The CLI agent as a process; with ``enter_dirs`` it first moves itself into those cgroups (what
    systemd does before it execs a unit's command)."""
    sock = tmp_path / "a.sock"
    argv = [sys.executable, "-m", "agent.cli", "agent", "--socket", str(sock), "--state-dir", str(tmp_path / "st"),
            "--period", "0.2", "--no-resize", *args]
    script = "".join(f'echo $$ > "{d}/cgroup.procs" && ' for d in enter_dirs) + 'exec "$@"'
    proc = subprocess.Popen(["sh", "-c", script, "sh", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None:
            return proc, None
        assert time.monotonic() < deadline, "agent did not start"
        time.sleep(0.1)
    return proc, AgentClient(str(sock))


def workload(client, name):
    return next(w for w in client.request("GET", "/v1/workloads")["workloads"] if w["name"] == name)


def in_process_agent(tmp_path, parent):
    """An agent in the test's process, its tree ``tidal-test-<id>`` under ``parent`` ("/" or "self")."""
    from agent.daemon import Agent, AgentConfig

    agent = Agent(AgentConfig(socket_path=str(tmp_path / "i.sock"), state_dir=str(tmp_path / "st"), reserved_cpus=(),
                              cgroup_base=f"tidal-test-{uuid.uuid4().hex[:8]}", cgroup_parent=parent,
                              empty_grace=3600, resize=False, drift_check_period=0, watch_period=0),
                  echo=lambda line: None)
    agent.start()
    return agent


def stop_agent(proc):
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


@needs_two_cpus
def test_an_agent_in_a_delegated_unit_keeps_no_process_where_controllers_are_distributed(tmp_path, outside, procs):
    """systemd with Delegate=yes starts the agent in its unit's cgroup; with ``--cgroup-parent self`` Tidal's
    tree goes there. v2 lets a cgroup distribute controllers only without processes of its own, so the
    agent moves itself into ``<base>/system`` first; a revert gives the unit's cgroup back as it was."""
    tag = uuid.uuid4().hex[:8]
    unit = f"tidal-test-{tag}.slice/tidal-{tag}.service"
    outside.make(unit)
    if V2:
        os.setxattr(outside.dir(unit), "trusted.delegate", b"1")  # what systemd marks a delegated cgroup with
    dirs = [outside.driver._dir(c, unit) for c in outside.driver._distinct]
    agent, client = start_agent(tmp_path, ["--cgroup-parent", "self", "--cgroup-base", "tidal", "--revert"], dirs)
    assert client is not None, agent.stdout.read()
    try:
        client.request("POST", "/v1/workloads", {"name": "web", "qos": "shared_cores", "millicpu": 100})
        sleeper = procs()
        client.request("POST", "/v1/workloads/web/attach", {"pid": sleeper.pid})
        assert cgroup_of(agent.pid) == f"/{unit}/tidal/system"
        assert cgroup_of(sleeper.pid) == f"/{unit}/tidal/shared/web"
        pools = client.request("GET", "/v1/status")["pools"]
        assert allowed(sleeper.pid) == set(parse_cpulist(pools["shared"]))
        # the rule, everywhere in the unit's subtree: a cgroup with children holds no process
        for path in [unit] + _walk(outside.driver, unit):
            directory = outside.dir(path)
            children = [e for e in os.listdir(directory) if os.path.isdir(os.path.join(directory, e))]
            members = open(os.path.join(directory, "cgroup.procs")).read().split()
            assert not (children and members), (path, children, members)
        if V2:
            assert {"cpuset", "cpu"} <= set(open(os.path.join(outside.dir(unit), "cgroup.subtree_control")).read().split())
    finally:
        out = stop_agent(agent)
    assert agent.returncode == 0 and "reverted" in out, out
    assert outside.driver.children(unit) == []  # the tree is gone
    if V2:
        assert open(os.path.join(outside.dir(unit), "cgroup.subtree_control")).read().split() == []


@v2_rule
@pytest.mark.parametrize("case", ["not-delegated", "no-cpuset"])
def test_a_parent_tidal_cannot_use_is_one_error_and_nothing_made(tmp_path, outside, case):
    tag = uuid.uuid4().hex[:8]
    unit = f"tidal-test-{tag}.slice/tidal-{tag}.service"
    if case == "no-cpuset":
        outside.make(unit, controllers=("cpu", "memory"))  # the slice does not hand cpuset down
        os.setxattr(outside.dir(unit), "trusted.delegate", b"1")
        expected = "the cpuset controller is not available"
    else:
        outside.make(unit)
        expected = "not delegated"
    agent, client = start_agent(tmp_path, ["--cgroup-parent", "self"], [outside.dir(unit)])
    if client is not None:
        stop_agent(agent)
        pytest.fail("the agent started under a parent it cannot use")
    out = agent.stdout.read()
    lines = [line for line in out.splitlines() if line.strip()]
    assert agent.returncode != 0 and len(lines) == 1 and expected in lines[0], out
    assert lines[0].startswith("tidal: error:")
    assert outside.driver.children(unit) == []  # nothing half-built
    assert open(os.path.join(outside.dir(unit), "cgroup.subtree_control")).read().split() == []


@needs_two_cpus
@pytest.mark.parametrize("driver_name", ["cgroupfs", "systemd"])
def test_a_pods_cpuset_is_written_into_the_kubelets_cgroups_of_either_layout(tmp_path, outside, procs, driver_name):
    """The kubelet made the pod's cgroup and its container's (its cgroup driver decides the names);
    Tidal writes the assignment there through its one Reconciler, never makes or removes them, and puts
    the original values back on revert."""
    from agent.isolation.cgroups.layout import kubelet_container_path, kubelet_pod_path
    from agent.qrm.model import KUBERNETES

    uid = str(uuid.uuid4())
    cid = uuid.uuid4().hex
    # the kubelet's layout below a unique top cgroup: a real kubelet's (or another test's) kubepods stays apart
    top = f"tidal-test-kube-{uuid.uuid4().hex[:8]}"
    pod = f"{top}/{kubelet_pod_path(driver_name, 'Guaranteed', uid)}"
    container = f"{top}/{kubelet_container_path(driver_name, 'Guaranteed', uid, f'containerd://{cid}')}"
    outside.make(container)
    worker = procs()
    outside.enter(container, worker.pid)
    before = allowed(worker.pid)
    agent = in_process_agent(tmp_path, "/")
    try:
        agent.admit({"name": "pod/u1", "qos": "dedicated_cores", "cpus": 1}, source=KUBERNETES)
        agent.place("pod/u1", [pod, container])
        report = agent.reconcile(verify=True)
        assert report.ok, report.failed
        cpus = set(agent.state.get("pod/u1").cpus)
        assert allowed(worker.pid) == cpus != before
        for path in (pod, container):
            assert set(parse_cpulist(open(os.path.join(outside.dir(path), "cpuset.cpus")).read())) == cpus
        assert container not in report.created and pod not in report.created
    finally:
        originals = dict(agent.enforcement.reconciler.originals)
        reverted = agent.enforcement.reconciler.revert()
        agent.shutdown()
    assert os.path.isdir(outside.dir(container))  # the kubelet's cgroups stay
    assert allowed(worker.pid) == before, (originals, reverted)  # and hold what they held


@needs_two_cpus
def test_dedicated_cores_are_a_cpuset_partition_where_the_kernel_allows(tmp_path, procs):
    """v2 on Linux >= 6.7: the dedicated workload's cpus leave the root partition, so a process that Tidal
    never touched, anywhere else on the machine, can no longer run there. v1 (and older kernels): plain
    cpusets, and ``tidal status`` says why."""
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    agent, client = start_agent(tmp_path, ["--reserved-cpus", "none", "--cgroup-base", base, "--revert"])
    assert client is not None, agent.stdout.read()
    try:
        client.request("POST", "/v1/workloads", {"name": "web", "qos": "dedicated_cores", "cpus": 1})
        worker = procs()
        client.request("POST", "/v1/workloads/web/attach", {"pid": worker.pid})
        status = client.request("GET", "/v1/status")
        web = workload(client, "web")
        cpus = set(parse_cpulist(web["cpus"]))
        assert allowed(worker.pid) == cpus
        bystander = subprocess.Popen(["sleep", "30"])  # started after, outside Tidal's tree
        try:
            isolation = status["dedicated_isolation"]
            if V2 and "partition" in isolation["mode"]:
                assert isolation["mode"] == "partition (root)" and not isolation["refused"]
                leaf = os.path.join(web["cgroup_dirs"]["unified"], "cpuset.cpus.partition")
                assert open(leaf).read().strip() == "root" and web["partition"] == "root"
                assert not allowed(bystander.pid) & cpus  # out of everyone else's scheduling domain
                isolated = open("/sys/fs/cgroup/cpuset.cpus.effective").read()
                assert not set(parse_cpulist(isolated)) & cpus
            else:
                assert isolation["mode"] == "cpuset" and isolation["why"]
                assert ("cgroup v1" in isolation["why"]) if not V2 else ("6.7" in isolation["why"])
                assert allowed(bystander.pid) & cpus  # a plain cpuset keeps no one else off
        finally:
            bystander.kill()
            bystander.wait()
        text = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--socket", str(tmp_path / "a.sock")],
                              capture_output=True, text=True, timeout=60).stdout
        assert f"dedicated cores: {isolation['mode']}" in text, text
    finally:
        out = stop_agent(agent)
    assert agent.returncode == 0, out


@pytest.mark.skipif(not V2, reason="partitions are cgroup v2 only; the v1 statement is checked above")
@needs_two_cpus
def test_a_partition_the_kernel_refuses_falls_back_to_a_plain_cpuset_and_says_so(tmp_path, outside, procs):
    """Someone else already holds the cpus exclusively (a sibling partition at the root): the kernel
    refuses Tidal's exclusive cpus. The workload still gets its cpus as a plain cpuset, nothing fails,
    and status names the refusal."""
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    agent, client = start_agent(tmp_path, ["--reserved-cpus", "none", "--cgroup-base", base, "--revert"])
    assert client is not None, agent.stdout.read()
    try:
        # which cpu a dedicated workload gets here (the choice is deterministic): then someone claims it
        client.request("POST", "/v1/workloads", {"name": "probe", "qos": "dedicated_cores", "cpus": 1})
        taken = workload(client, "probe")["cpus"]
        client.request("DELETE", "/v1/workloads/probe")
        claim = f"tidal-test-claim-{uuid.uuid4().hex[:8]}"
        outside.make(claim)
        with open(os.path.join(outside.dir(claim), "cpuset.cpus"), "w") as handle:
            handle.write(taken)
        with open(os.path.join(outside.dir(claim), "cpuset.cpus.exclusive"), "w") as handle:
            handle.write(taken)
        client.request("POST", "/v1/workloads", {"name": "web", "qos": "dedicated_cores", "cpus": 1})
        worker = procs()
        client.request("POST", "/v1/workloads/web/attach", {"pid": worker.pid})
        web = workload(client, "web")
        assert web["cpus"] == taken
        confined = allowed(worker.pid) == set(parse_cpulist(web["cpus"]))
        status = client.request("GET", "/v1/status")
        leaf = open(os.path.join(web["cgroup_dirs"]["unified"], "cpuset.cpus.partition")).read().strip()
        text = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--socket", str(tmp_path / "a.sock")],
                              capture_output=True, text=True, timeout=60).stdout
    finally:
        out = stop_agent(agent)
    assert agent.returncode == 0, out
    assert confined, out
    assert status["dedicated_isolation"]["refused"], (status["dedicated_isolation"], out)
    assert status["counters"]["reconcile_failures"] == 0, out
    assert leaf == "member" and web["partition"].startswith("member (")
    assert "partition refused" in text, text


def test_pressure_per_cgroup_is_read_through_the_driver(tmp_path, procs):
    """PSI (cpu, memory, io; some and full) of one of Tidal's cgroups: v2 natively, a hybrid v1 host
    from the cgroup2 mirror its workloads are members of."""
    agent = in_process_agent(tmp_path, "self")
    base = agent.config.cgroup_base
    try:
        if agent.driver.membership_dir(base) is None:
            pytest.fail("no cgroup2 hierarchy on this host: per-cgroup PSI has nowhere to come from")
        agent.admit({"name": "hog", "qos": "reclaimed_cores", "millicpu": 100})
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        try:
            for hog in hogs:
                agent.attach("hog", hog.pid)
            one = min(allowed(hogs[0].pid))
            for hog in hogs:  # two on one cpu: each is runnable and waiting half the time
                os.sched_setaffinity(hog.pid, {one})
            path = f"{base}/reclaimed/low/hog"
            first = agent.driver.pressure(path, "cpu")
            time.sleep(1.5)
            second = agent.driver.pressure(path, "cpu")
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        assert set(first) >= {"some"} and {"avg10", "avg60", "avg300", "total"} <= set(first["some"])
        assert second["some"]["total"] - first["some"]["total"] > 100_000  # µs: they waited for their cpu
        for resource in ("memory", "io"):
            figures = agent.driver.pressure(path, resource)
            assert figures is not None and {"some", "full"} <= set(figures), (resource, figures)
    finally:
        agent.enforcement.reconciler.revert()
        agent.shutdown()


def test_memory_protection_knobs_reach_the_kernel_where_it_has_them():
    """memory.min/low (protection of online work) and memory.high/max (reclaimed work), through the
    one knob table: written and read back on v2; v1 has no min/low/high, and the table writes nothing
    for them there (never a wrong file)."""
    from agent.isolation.cgroups.desired import CgroupSpec
    from agent.isolation.cgroups.reconcile import Reconciler

    driver = KernelCgroups(detect(HostFS("/")), parent="self")
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    every = {"cpus": ",".join(map(str, TOPO.online_cpus())), "mems": "0"}
    mib = 1 << 20
    knobs = {"memory_min": 64 * mib, "memory_low": 128 * mib, "memory_high": 512 * mib, "memory_max": 1024 * mib}
    reconciler = Reconciler(driver, base)
    try:
        report = reconciler.apply([CgroupSpec(base, every), CgroupSpec(f"{base}/online", {**every, **knobs})])
        assert report.ok, report.failed
        if V2:
            for knob, value in knobs.items():
                assert int(driver.read("", f"{base}/online", knob.replace("_", "."))) == value, knob
        else:
            assert int(driver.read("memory", f"{base}/online", "memory.limit_in_bytes")) == 1024 * mib
            written = {file for _, file, _ in report.written}
            assert not written & {"memory.min", "memory.low", "memory.high"}
    finally:
        reconciler.revert()
    assert not driver.exists(base)

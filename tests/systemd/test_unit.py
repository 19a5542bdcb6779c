"""The shipped unit under real systemd (make test-systemd: systemd as PID 1, pure cgroup v2, in a VM).

Tidal is installed as the README says (``make install``, done by the tier before this runs); these
tests drive it with ``systemctl`` and the ``tidal`` CLI only, and read the kernel's cgroup files and
``/proc`` to see what systemd and the agent did. They run in file order: one agent, one set of
workloads, carried through start, daemon-reload, restart, the watchdog and stop.
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest

pytestmark = pytest.mark.systemd

UNIT = "tidal.service"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CGROUP = "/sys/fs/cgroup"
# capability numbers (linux/capability.h) of the names the unit's bounding set uses
CAPS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3, "CAP_KILL": 5,
        "CAP_SETUID": 7, "CAP_NET_ADMIN": 12, "CAP_SYS_PTRACE": 19, "CAP_SYS_ADMIN": 21, "CAP_SYS_NICE": 23,
        "CAP_SYS_RESOURCE": 24}


def sh(*argv, check=True, timeout=120):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def show(*props):
    out = sh("systemctl", "show", UNIT, *(f"--property={p}" for p in props))
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def tidal(*args):
    return json.loads(sh("tidal", *args, "--json"))


def read(path):
    with open(path) as handle:
        return handle.read().strip()


def cgroup_of(pid):
    for line in read(f"/proc/{pid}/cgroup").splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"pid {pid}: no cgroup v2 line in /proc/{pid}/cgroup")


def unit_lines(key):
    with open(os.path.join(REPO, "systemd", "tidal.service")) as handle:
        return [line.split("=", 1)[1].strip() for line in handle if line.startswith(f"{key}=")]


class Node:
    """The workloads the tests started and what the kernel says of them."""

    def __init__(self):
        self.procs = {}  # name -> Popen of `tidal run ... sleep`

    def start(self, name, *flags):
        self.procs[name] = subprocess.Popen(["tidal", "run", "--name", name, *flags, "sleep", "100000"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while True:
            listed = {w["name"]: w for w in tidal("ps")}
            if name in listed and self.procs[name].pid in listed[name]["pids"]:
                return listed[name]
            assert self.procs[name].poll() is None, f"tidal run {name}: {self.procs[name].stderr.read().decode()}"
            assert time.monotonic() < deadline, f"{name} not attached in 60 s: {listed.get(name)}"
            time.sleep(0.2)

    def confinement(self):
        """Each workload's process: its cgroup and the kernel's values there (not the agent's word)."""
        seen = {}
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"workload {name}'s process exited ({proc.returncode})"
            path = cgroup_of(proc.pid)
            directory = f"{CGROUP}{path}"
            values = {"cgroup": path}
            for knob in ("cpuset.cpus.effective", "cpuset.mems.effective", "cpu.weight", "cpu.idle", "cpu.max"):
                # a reclaimed workload's own quota follows the agent's measure of idle time (the minimum while
                # it may not take idle cpus, none once it may: desired.py), which a new agent takes afresh
                if knob == "cpu.max" and name == "reclaimed":
                    continue
                if os.path.exists(f"{directory}/{knob}"):
                    values[knob] = read(f"{directory}/{knob}")
            seen[name] = values
        return seen

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


def tree_of(agent_pid):
    """Tidal's tree as the agent reports it: the parent of its workloads' cgroups."""
    listed = tidal("ps")
    assert listed, "no workloads"
    dirs = [w["cgroup_dirs"]["unified"] for w in listed if w.get("cgroup_dirs")]
    return os.path.commonpath(dirs)


@pytest.fixture(scope="module")
def node():
    n = Node()
    yield n
    n.stop()
    for name in list(n.procs):
        subprocess.run(["tidal", "release", name], capture_output=True)
    subprocess.run(["systemctl", "disable", "--now", UNIT], capture_output=True)


def test_installed_as_shipped():
    with open(os.path.join(REPO, "systemd", "tidal.service")) as shipped, \
            open(f"/etc/systemd/system/{UNIT}") as installed:
        assert installed.read() == shipped.read()
    assert os.path.exists("/etc/tidal/agent.yaml")
    assert read("/proc/1/comm") == "systemd"
    assert not any(line.split()[2] == "cgroup" for line in read("/proc/self/mounts").splitlines())


def test_confine_host_cgroups_refuses_a_systemd_host_with_one_line(tmp_path):
    """--confine-host-cgroups is for hosts without systemd: here systemd owns the cgroups, and the agent
    says which option is this host's before it makes anything."""
    base = "tidal-refused-host-cgroups"
    done = subprocess.run(["tidal", "agent", "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "st"),
                           "--cgroup-base", base, "--confine-host-cgroups", "/system.slice"],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "--confine-host-units" in lines[0], done.stderr
    assert not os.path.exists(f"{CGROUP}/{base}") and not os.path.exists(tmp_path / "st" / "checkpoint.json")


def test_enable_now_waits_for_readiness(node):
    start = time.monotonic()
    sh("systemctl", "enable", "--now", UNIT, timeout=300)
    ready_s = time.monotonic() - start
    props = show("ActiveState", "SubState", "Type", "StatusText", "MainPID", "NRestarts", "ControlGroup")
    print(f"systemctl enable --now: {ready_s:.1f} s to READY=1; {props}")
    assert props["Type"] == "notify"
    assert (props["ActiveState"], props["SubState"]) == ("active", "running")
    # READY=1 comes with the socket it serves: systemctl returned once the agent answered
    assert props["StatusText"] == "serving /run/tidal/tidal.sock"
    assert tidal("status")["cgroup_version"] == 2


def test_hardening_in_force():
    props = show("MainPID", "ControlGroup")
    pid = int(props["MainPID"])
    status = dict(line.split(":", 1) for line in read(f"/proc/{pid}/status").splitlines())
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # RestrictAddressFamilies, LockPersonality, ... as a filter
    (bounding,) = unit_lines("CapabilityBoundingSet")
    mask = sum(1 << CAPS[name] for name in bounding.split())
    assert int(status["CapBnd"], 16) == mask, f"CapBnd {status['CapBnd'].strip()}, the unit's {bounding}"
    assert int(status["CapEff"], 16) == mask
    (memory_max,) = unit_lines("MemoryMax")
    assert memory_max == "256M"
    assert read(f"{CGROUP}{props['ControlGroup']}/memory.max") == str(256 << 20)
    mounts = {}
    for line in read(f"/proc/{pid}/mountinfo").splitlines():
        fields = line.split()
        mounts[fields[4]] = (fields[3], fields[5].split(","))  # mount point -> (root, options)
    assert "ro" in mounts["/"][1], "ProtectSystem=strict: / read-only for the agent"
    for path in ("/sys/fs/cgroup", "/var/lib/tidal", "/run/tidal"):
        assert "rw" in mounts[path][1], f"{path} must be writable for the agent (ReadWritePaths)"
    assert "/tmp" in mounts and "systemd-private" in mounts["/tmp"][0], "PrivateTmp: a /tmp of its own"
    print("systemd-analyze security: " + sh("systemd-analyze", "security", UNIT, "--no-pager", check=False)
          .strip().splitlines()[-1])


def test_workloads_confined(node):
    dedicated = node.start("dedicated", "--qos", "dedicated_cores", "--cpus", "1")
    shared = node.start("shared", "--qos", "shared_cores", "--millicpu", "500")
    # reclaimed capacity is what online leaves idle, measured over the first periods: wait for room
    deadline = time.monotonic() + 90
    while tidal("status")["reclaimed_capacity_millicpu"] < 200:
        assert time.monotonic() < deadline, f"no 200 millicpu reclaimed capacity in 90 s: {tidal('status')['pools']}"
        time.sleep(1)
    node.start("reclaimed", "--qos", "reclaimed_cores", "--millicpu", "200", "--tier", "low")
    seen = node.confinement()
    props = show("MainPID", "ControlGroup")
    agent = int(props["MainPID"])
    tree = tree_of(agent)
    print(f"Tidal's tree: {tree}; agent in {cgroup_of(agent)}; {seen}")
    # the agent stays in its unit (MemoryMax=, systemd's accounting) on the reserved cpus by affinity
    assert cgroup_of(agent) == props["ControlGroup"] == "/system.slice/tidal.service"
    reserved = tidal("status")["pools"]["reserved"]
    for tid in os.listdir(f"/proc/{agent}/task"):
        allowed = dict(line.split(":", 1) for line in read(f"/proc/{agent}/task/{tid}/status").splitlines())
        assert cpu_list(allowed["Cpus_allowed_list"].strip()) == cpu_list(reserved), (tid, allowed["Cpus_allowed_list"])
    for name, values in seen.items():
        assert f"{CGROUP}{values['cgroup']}".startswith(tree + "/"), (name, values, tree)
    assert cpu_list(seen["dedicated"]["cpuset.cpus.effective"]) == cpu_list(dedicated["cpus"])
    assert shared["cpus"] and not set(cpu_list(shared["cpus"])) & set(cpu_list(dedicated["cpus"]))
    assert cpu_list(seen["shared"]["cpuset.cpus.effective"]) == cpu_list(shared["cpus"])
    # reclaimed work runs at the idle policy: its cgroup or one above it in Tidal's tree has cpu.idle 1
    path, idle = f"{CGROUP}{seen['reclaimed']['cgroup']}", []
    while path != tree:
        idle.append(read(f"{path}/cpu.idle"))
        path = os.path.dirname(path)
    assert "1" in idle, idle
    node.before = seen


def test_reclaimed_work_never_runs_on_a_dedicated_cpus_sibling(node):
    """The VM's cores have two threads (scripts/systemd-vm.sh): the dedicated cpu's sibling thread is
    held back from reclaimed work, by the kernel's word (its cpuset and the process's affinity)."""
    status = tidal("status")
    assert status["smt"]["threads_per_core"] == 2, status["smt"]
    (dedicated,) = cpu_list(node.before["dedicated"]["cpuset.cpus.effective"])
    siblings = cpu_list(read(f"/sys/devices/system/cpu/cpu{dedicated}/topology/thread_siblings_list"))
    (sibling,) = set(siblings) - {dedicated}
    assert status["smt"]["held_back"] == [{"cpu": sibling, "sibling_of": "dedicated"}], status["smt"]
    reclaimed = node.procs["reclaimed"].pid
    allowed = dict(line.split(":", 1) for line in read(f"/proc/{reclaimed}/status").splitlines())
    cpus = cpu_list(allowed["Cpus_allowed_list"].strip())
    effective = cpu_list(read(f"{CGROUP}{cgroup_of(reclaimed)}/cpuset.cpus.effective"))
    print(f"dedicated cpu {dedicated}, its sibling {sibling}; reclaimed work on {cpus} (cpuset {effective})")
    assert cpus and sibling not in cpus and dedicated not in cpus, cpus
    assert effective and sibling not in effective, effective
    # the shared workload's cpus may hold the sibling: online beside online is the node's own choice
    assert sibling in cpu_list(status["pools"]["shared"]) or sibling in cpu_list(status["pools"]["reserved"])


def unit_cpus(unit):
    """systemd's word (AllowedCPUs=, empty: unset) and the kernel's (the unit's cpuset.cpus.effective)."""
    props = dict(line.split("=", 1) for line in sh("systemctl", "show", unit, "--property=AllowedCPUs",
                                                     "--property=ControlGroup").splitlines() if "=" in line)
    return cpu_list(props["AllowedCPUs"]), cpu_list(read(f"{CGROUP}{props['ControlGroup']}/cpuset.cpus.effective"))


HOST_UNITS = ["system.slice", "user.slice", "init.scope"]


def test_the_host_units_are_held_on_the_reserved_cpus(node):
    """The shipped /etc/tidal/agent.yaml holds system.slice, user.slice and init.scope on the reserved cpus
    through systemd; what starts there later (a service, a login) is on them too."""
    status = tidal("status")
    reserved = cpu_list(status["pools"]["reserved"])
    assert reserved and status["host_units"]["units"] == HOST_UNITS and status["host_units"]["errors"] == {}
    for unit in HOST_UNITS:
        assert unit_cpus(unit) == (reserved, reserved), unit
    with open("/var/lib/tidal/host-units.json") as handle:  # their own values, saved before the first change
        assert json.load(handle) == {"original_allowed_cpus": {unit: [] for unit in HOST_UNITS}}
    sh("systemd-run", "--unit=tidal-foreign", "--slice=system.slice", "sleep", "100000")
    try:
        pid = int(sh("systemctl", "show", "tidal-foreign", "--property=MainPID", "--value").strip())
        assert cgroup_of(pid) == "/system.slice/tidal-foreign.service"
        assert cpu_list(read(f"{CGROUP}/system.slice/tidal-foreign.service/cpuset.cpus.effective")) == reserved
        allowed = dict(line.split(":", 1) for line in read(f"/proc/{pid}/status").splitlines())
        assert cpu_list(allowed["Cpus_allowed_list"].strip()) == reserved
    finally:
        sh("systemctl", "stop", "tidal-foreign", check=False)
    # someone else moves a unit off (an operator's set-property): the next drift check holds it again
    sh("systemctl", "set-property", "--runtime", "user.slice", "AllowedCPUs=")
    assert unit_cpus("user.slice")[0] == []
    start = time.monotonic()
    while unit_cpus("user.slice") != (reserved, reserved):
        assert time.monotonic() - start < 30 + 15, "user.slice not held again within a drift check (30 s)"
        time.sleep(0.5)
    print(f"user.slice held again {time.monotonic() - start:.1f} s after it was moved off")
    assert tidal("status")["host_units"]["drift_repairs"] == 1


def cpu_list(text):
    cpus = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus += range(int(lo), int(hi) + 1)
        elif part:
            cpus.append(int(part))
    return cpus


def controllers_along(path):
    """cgroup.subtree_control of each cgroup from the root down to ``path``'s parent."""
    out, parts = {}, path[len(CGROUP):].strip("/").split("/")
    for i in range(len(parts)):
        directory = "/".join([CGROUP] + parts[:i])
        out[directory] = read(f"{directory}/cgroup.subtree_control")
    return out


def test_daemon_reload_leaves_the_tree_alone(node):
    leaf = f"{CGROUP}{node.before['dedicated']['cgroup']}"
    enabled = controllers_along(leaf)
    sh("systemctl", "daemon-reload")
    time.sleep(3)  # systemd realises the units' cgroups as it reloads; give anything lazy a moment
    assert node.confinement() == node.before
    assert controllers_along(leaf) == enabled
    assert show("ActiveState")["ActiveState"] == "active"
    reserved = cpu_list(tidal("status")["pools"]["reserved"])
    for unit in HOST_UNITS:  # systemd's own runtime properties, which a reload keeps
        assert unit_cpus(unit) == (reserved, reserved), unit


def test_restart_keeps_every_workload_confined(node):
    before = show("MainPID", "NRestarts")
    sh("systemctl", "restart", UNIT, timeout=300)
    after = show("MainPID", "NRestarts", "ActiveState")
    assert after["ActiveState"] == "active" and after["MainPID"] != before["MainPID"]
    assert node.confinement() == node.before
    listed = {w["name"]: w for w in tidal("ps")}
    assert set(listed) >= set(node.procs)
    for name, proc in node.procs.items():
        assert proc.pid in listed[name]["pids"]


def test_watchdog_restarts_a_hung_agent(node):
    before = show("MainPID", "NRestarts")
    (watchdog,) = unit_lines("WatchdogSec")
    os.kill(int(before["MainPID"]), signal.SIGSTOP)  # hung: alive, no WATCHDOG=1
    stopped = time.monotonic()
    deadline = stopped + int(watchdog) + 90
    while True:
        now = show("MainPID", "NRestarts", "ActiveState", "SubState")
        if now["NRestarts"] != before["NRestarts"] and now["ActiveState"] == "active" and now["SubState"] == "running":
            break
        assert time.monotonic() < deadline, f"no restart {int(watchdog) + 90} s after the agent hung: {now}"
        time.sleep(0.5)
    took = time.monotonic() - stopped
    print(f"watchdog: hung agent replaced after {took:.1f} s (WatchdogSec={watchdog})")
    assert int(now["NRestarts"]) == int(before["NRestarts"]) + 1
    assert now["MainPID"] != before["MainPID"]
    assert took >= int(watchdog) - 1
    journal = sh("journalctl", "-b", "-u", UNIT, "--no-pager", "-o", "cat")
    assert re.search(r"[Ww]atchdog timeout", journal), journal[-2000:]
    assert node.confinement() == node.before


def test_stop_leaves_workloads_confined_and_start_finds_them(node):
    sh("systemctl", "stop", UNIT, timeout=300)
    assert show("ActiveState")["ActiveState"] in ("inactive", "failed")
    # KillMode=process: the workloads are not the unit's to kill, and stay where they were
    assert node.confinement() == node.before
    sh("systemctl", "start", UNIT, timeout=300)
    listed = {w["name"]: w for w in tidal("ps")}
    for name, proc in node.procs.items():
        assert proc.pid in listed[name]["pids"]
    assert node.confinement() == node.before


def test_revert_gives_the_host_units_their_own_cpus(node):
    """`tidal agent --revert` (the agent's clean removal) gives each held unit its saved value back."""
    sh("systemctl", "stop", UNIT, timeout=300)
    agent = subprocess.Popen(["tidal", "agent", "--config", "/etc/tidal/agent.yaml", "--revert"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(["tidal", "status", "--json"], capture_output=True).returncode != 0:
            assert agent.poll() is None, agent.stdout.read()
            assert time.monotonic() < deadline, "the agent did not serve in 120 s"
            time.sleep(0.5)
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    print(out.strip().splitlines()[-3:])
    assert agent.returncode == 0, out
    assert "host units given back their own cpus" in out
    every = cpu_list(read(f"{CGROUP}/cpuset.cpus.effective"))  # the dedicated cpu's partition is gone too
    assert every == cpu_list(read("/sys/devices/system/cpu/online"))
    for unit in HOST_UNITS:
        assert unit_cpus(unit) == ([], every), unit
    assert not os.path.exists("/var/lib/tidal/host-units.json")

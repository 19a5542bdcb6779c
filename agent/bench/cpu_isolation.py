"""``tidal bench cpu-isolation``: online latency and offline harvest, side by side.

An online latency probe (a request of fixed work every ``period_ms``;
latency = tick to done) runs alone, then beside offline CPU hogs (one per
cpu) under four treatments:

* ``none``: hogs beside the probe, no isolation;
* ``besteffort``: the kubelet's BestEffort treatment, hogs at ``cpu.shares=2``;
* ``static_split``: a static cpuset split, probe on one cpu, hogs on the rest;
* ``tidal``: Tidal's agent in-process on real cgroups: the probe a
  ``shared_cores`` workload, the hogs ``reclaimed_cores``, the agent's loop
  running (usage sampling, reclaim sizing, reconcile).

With ``--foreign-load SLICE`` (a systemd host) two more: the host's own work outside Tidal's and the
kubelet's trees, one process per cpu each busy half of every 20 ms (a normal priority: journald, a
monitoring agent, an operator's build), runs in a transient unit in ``SLICE`` beside ``tidal``:

* ``tidal_foreign``: the slice on every cpu, as systemd leaves it;
* ``tidal_foreign_confined``: the agent holding the slice on the reserved cpus through systemd
  (``--confine-host-units SLICE``, ``services.host_units``), given back after.

The harness must not run in that slice (it would be confined with it): run it from a delegated scope
of its own, ``systemd-run --scope -p Delegate=yes --slice=tidal-bench.slice tidal bench cpu-isolation
--foreign-load system.slice``.

On a host without systemd, ``--foreign-load cgroup``: the same load in a cgroup the bench makes beside
Tidal's tree (as such a host's init scripts make ``/system`` or ``/docker``), on every cpu in
``tidal_foreign``, and in ``tidal_foreign_confined`` held on the reserved cpus by the agent's Reconciler
(``--confine-host-cgroups``), its values put back after; the cgroup is removed at the end.

Offline harvest = hogs' cpu time / the cpu time the probe left idle
(cpus x duration - probe cpu time). The scenarios take turns in short runs,
``repeats`` rounds of them; latency percentiles are over all rounds' samples
pooled, harvest is the median round's. Needs root (real cgroups); everything is created under this
process's own cgroups with unique names and removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

import psutil

from common.timing import median, percentile
from agent.errors import TidalError
from agent.isolation.cgroups.desired import CgroupOptions, CgroupSpec
from agent.topology.parse import format_cpulist


# ---- the processes (run as `python -m agent.bench.cpu_isolation probe|hog`) ----

def calibrate(work_us: int) -> int:
    """Loops of the probe's request that take ``work_us`` on this cpu, now."""
    n = 1000
    while True:
        start = time.perf_counter()
        x = 0
        for i in range(n):
            x += i * i
        elapsed = (time.perf_counter() - start) * 1e6
        if elapsed >= 2000:
            return max(1, int(n * work_us / elapsed))
        n *= 2


def probe_main(period_ms: float, work_us: int, duration: float, start_at: Optional[float] = None,
               loops: Optional[int] = None) -> None:
    """Requests every ``period_ms``, then its latencies (and cpu time) as one JSON line. As a process of the
    harness: calibrated, it says ``ready`` and starts on a line on stdin. In a pod (``start_at``, epoch
    seconds, and ``loops``, calibrated by whoever made the pod while nothing competed): it starts then."""
    if start_at is None:
        loops = calibrate(work_us)
        print("ready", flush=True)
        sys.stdin.readline()  # wait until placed in its cgroup
    else:
        time.sleep(max(0.0, start_at - time.time()))
    period = period_ms / 1000.0
    latencies: List[float] = []
    wait0 = run_delay_s()
    cpu0 = time.process_time()
    next_tick = time.perf_counter() + period
    end = next_tick + duration
    while next_tick < end:
        delay = next_tick - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        x = 0
        for i in range(loops):
            x += i * i
        latencies.append((time.perf_counter() - next_tick) * 1e6)
        next_tick += period
    wait = run_delay_s()
    print(json.dumps({"latencies_us": latencies, "cpu_s": time.process_time() - cpu0,
                      "wait_s": None if wait is None or wait0 is None else wait - wait0}), flush=True)


def run_delay_s() -> Optional[float]:
    """Seconds this process has waited runnable for a cpu, by the kernel's scheduler (``/proc/self/schedstat``,
    its second field): the queueing a request met, apart from how fast the cpu ran it (under emulation, or
    where a hypervisor takes the cpu away, the latency carries that too, the wait does not); None without
    CONFIG_SCHED_INFO."""
    try:
        with open("/proc/self/schedstat") as handle:
            return int(handle.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def hog_main() -> None:
    sys.stdin.readline()
    x = 0
    while True:
        x += 1


def foreign_main(processes: int, duty: float, period_ms: float, gate: bool = False) -> None:
    """The host's own work: ``processes`` processes, each busy ``duty`` of every ``period_ms`` (at
    phases spread over the period), until killed (with its unit, or its process group). ``gate``: fork
    only after a line on stdin (the harness first moves this process into the load's cgroup)."""
    if gate:
        sys.stdin.readline()
    period = period_ms / 1000.0
    children = []
    for i in range(processes):
        pid = os.fork()
        if pid == 0:
            next_start = time.monotonic() + period * i / processes
            while True:
                delay = next_start - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                busy_until = time.monotonic() + period * duty
                while time.monotonic() < busy_until:
                    pass
                next_start += period
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)


FOREIGN_DUTY = 0.5
FOREIGN_PERIOD_MS = 20.0


class ForeignLoad:
    """``foreign_main`` in a transient systemd service in ``slice``, started and stopped per scenario."""

    def __init__(self, slice_unit: str, processes: int) -> None:
        self.slice, self.processes = slice_unit, processes
        self.unit: Optional[str] = None
        self.cgroup = ""
        self.ran_on = ""  # the load's effective cpus (the kernel's word) in the last scenario, read as it stops

    def start(self) -> None:
        self.unit = f"tidal-bench-foreign-{uuid.uuid4().hex[:8]}.service"
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = subprocess.run(["systemd-run", "--quiet", "--collect", f"--unit={self.unit}", f"--slice={self.slice}",
                               f"--setenv=PYTHONPATH={package_root}", "--", sys.executable, "-m",
                               "agent.bench.cpu_isolation", "foreign", str(self.processes), str(FOREIGN_DUTY),
                               str(FOREIGN_PERIOD_MS)], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            self.unit = None
            raise TidalError(f"--foreign-load: systemd-run refused the load's unit: {proc.stderr.strip()}")
        self.cgroup = subprocess.run(["systemctl", "show", self.unit, "--property=ControlGroup", "--value"],
                                     capture_output=True, text=True, timeout=60).stdout.strip()
        # running once every process of it is there (systemd-run returns when the main one started)
        deadline = time.monotonic() + 30
        while len(self.pids()) < self.processes + 1:
            if time.monotonic() > deadline:
                raise TidalError(f"--foreign-load: {self.unit} did not start its {self.processes} processes in 30 s")
            time.sleep(0.05)

    def pids(self) -> List[int]:
        path = f"/sys/fs/cgroup{self.cgroup}/cgroup.procs"
        try:
            with open(path) as handle:
                return [int(p) for p in handle.read().split()]
        except OSError:
            return []

    def stop(self) -> None:
        if self.unit is not None:
            try:
                with open(f"/sys/fs/cgroup{self.cgroup}/cpuset.cpus.effective") as handle:
                    self.ran_on = handle.read().strip()
            except OSError:
                self.ran_on = ""
            subprocess.run(["systemctl", "stop", self.unit], capture_output=True, timeout=60)
            self.unit = None


FOREIGN_CGROUP = "cgroup"  # --foreign-load cgroup: a host without systemd, the load in a cgroup of the bench's


class CgroupForeignLoad:
    """``foreign_main`` in a cgroup of the bench's own beside Tidal's tree (a host without systemd, whose
    own work lives in cgroups its init scripts made), its processes started and killed per scenario; the
    cgroup is made once (every cpu, as such a host leaves it) and removed at the end."""

    def __init__(self, driver, path: str, processes: int, cpus: str, mems: str) -> None:
        self.driver, self.path, self.processes = driver, path, processes
        self.cpus, self.mems = cpus, mems
        self.proc: Optional[subprocess.Popen] = None
        self.ran_on = ""  # where the load's processes could run in the last scenario (the kernel's word)
        self._made = False

    def make(self) -> None:
        from agent.isolation.cgroups.reconcile import Reconciler

        self._made = True
        report = Reconciler(self.driver, self.path).apply([CgroupSpec(self.path, {"cpus": self.cpus, "mems": self.mems})])
        if report.failed:
            raise TidalError(f"--foreign-load cgroup: {report.failed[0][2]}")

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "agent.bench.cpu_isolation", "foreign", str(self.processes),
                                      str(FOREIGN_DUTY), str(FOREIGN_PERIOD_MS), "gate"],
                                     stdin=subprocess.PIPE, text=True, start_new_session=True)
        self.driver.move(self.path, self.proc.pid)
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + 30
        while len(self.children()) < self.processes:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TidalError(f"--foreign-load cgroup: the load did not start its {self.processes} processes in 30 s")
            time.sleep(0.05)

    def children(self) -> List[int]:
        try:
            return [child.pid for child in psutil.Process(self.proc.pid).children()]
        except psutil.Error:
            return []

    def stop(self) -> None:
        if self.proc is None:
            return
        pids = self.children()
        self.ran_on = ""
        for pid in pids[:1]:
            try:
                with open(f"/proc/{pid}/status") as handle:
                    self.ran_on = next(line.split(":", 1)[1].strip() for line in handle
                                       if line.startswith("Cpus_allowed_list:"))
            except (OSError, StopIteration):
                pass
        try:
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        deadline = time.monotonic() + 10  # the children, reparented, are gone once the kernel reaped them
        while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def remove(self) -> None:
        from agent.isolation.cgroups.reconcile import Reconciler

        self.stop()
        if self._made:
            Reconciler(self.driver, self.path).revert()
            self._made = False


def check_foreign_cgroup(driver) -> None:
    """One line and nothing made where ``--foreign-load cgroup`` cannot mean what it says here."""
    from agent.isolation.cgroups.driver import own_cgroups
    from agent.topology import HostFS

    if os.path.isdir("/run/systemd/system"):
        raise TidalError("--foreign-load cgroup: systemd runs this host and owns its cgroups: name one of its "
                         "slices (--foreign-load system.slice)")
    own = own_cgroups(HostFS("/")).get("", "/")
    if driver.version == 2 and own != "/":
        raise TidalError(f"--foreign-load cgroup: on cgroup v2 the load's cgroup and Tidal's tree go beside this "
                         f"process, and a cgroup that holds processes ({own}) cannot hand cpusets to its children: "
                         f"run the bench from the root cgroup")


def check_foreign_slice(slice_unit: str) -> None:
    """One line and nothing started where ``--foreign-load`` cannot mean what it says here."""
    from agent.isolation.systemd import unit_type

    try:
        if unit_type(slice_unit) != "slice":
            raise ValueError(f"{slice_unit!r}: not a slice")
    except ValueError as exc:
        raise TidalError(f"--foreign-load: {exc}") from None
    if not os.path.isdir("/run/systemd/system"):
        raise TidalError("--foreign-load: systemd does not run this host (no /run/systemd/system): the load "
                         "goes in one of its slices and the agent holds it through systemd")
    own = ""
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            if line.startswith("0::"):
                own = line[3:].strip()
    if f"/{slice_unit}/" in f"{own}/" or slice_unit == "-.slice":
        raise TidalError(f"--foreign-load {slice_unit}: this harness runs in it ({own}) and would be confined "
                         f"with the load; run it from a scope of its own: systemd-run --scope -p Delegate=yes "
                         f"--slice=tidal-bench.slice tidal bench cpu-isolation --foreign-load {slice_unit}")


# ---- the harness ----------------------------------------------------------------

class _Run:
    def __init__(self, cpus: int, period_ms: float, work_us: int, duration: float, hogs: bool) -> None:
        cmd = [sys.executable, "-m", "agent.bench.cpu_isolation"]
        self.probe = subprocess.Popen(cmd + ["probe", str(period_ms), str(work_us), str(duration)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hogs = [subprocess.Popen(cmd + ["hog"], stdin=subprocess.PIPE, text=True) for _ in range(cpus if hogs else 0)]
        if self.probe.stdout.readline().strip() != "ready":  # calibrated, before anything competes with it
            raise TidalError("the latency probe failed to start")

    def go(self) -> None:
        for proc in self.hogs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        self._hog_cpu0 = [self._cpu(p.pid) for p in self.hogs]
        self.probe.stdin.write("go\n")
        self.probe.stdin.flush()

    @staticmethod
    def _cpu(pid: int) -> float:
        times = psutil.Process(pid).cpu_times()
        return times.user + times.system

    def finish(self, cpus: int, duration: float) -> Dict[str, Any]:
        out, _ = self.probe.communicate(timeout=duration * 4 + 60)
        result = json.loads(out)
        hog_cpu = sum(self._cpu(p.pid) - c0 for p, c0 in zip(self.hogs, self._hog_cpu0))
        self.kill()
        idle = max(1e-9, cpus * duration - result["cpu_s"])
        lat = result["latencies_us"]
        wait = result.get("wait_s")
        return {"latencies_us": lat, "offline_harvest": hog_cpu / idle if self.hogs else None,
                "wait_us": None if wait is None or not lat else wait * 1e6 / len(lat)}

    def kill(self) -> None:
        for proc in [self.probe, *self.hogs]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _scenario(name: str, cpus: int, args: Dict[str, Any], place: Callable[[_Run], Optional[Callable[[], None]]]):
    run = _Run(cpus, args["period_ms"], args["work_us"], args["duration"], hogs=name != "alone")
    cleanup = None
    try:
        cleanup = place(run)
        run.go()
        return run.finish(cpus, args["duration"])
    finally:
        run.kill()
        if cleanup:
            cleanup()


TREATMENTS = ("none", "besteffort", "static_split", "tidal")
FOREIGN_TREATMENTS = ("tidal_foreign", "tidal_foreign_confined")


def run(duration: float = 2.0, repeats: int = 10, period_ms: float = 5.0, work_us: int = 300,
        foreign_load: Optional[str] = None, treatments: Optional[List[str]] = None) -> Dict[str, Any]:
    """``treatments``: which of them run beside ``alone`` (default: all; the foreign ones only with
    ``foreign_load``: a systemd slice, or ``cgroup`` on a host without systemd)."""
    if os.geteuid() != 0:
        raise TidalError("bench cpu-isolation needs root: it creates cgroups")
    known = TREATMENTS + (FOREIGN_TREATMENTS if foreign_load else ())
    chosen = list(treatments) if treatments else list(known)
    for name in chosen:
        if name not in known:
            raise TidalError(f"bench cpu-isolation: no treatment {name!r} (known: {', '.join(known)}"
                             + ("" if foreign_load else f"; {', '.join(FOREIGN_TREATMENTS)} need --foreign-load") + ")")
    if foreign_load and foreign_load != FOREIGN_CGROUP:
        check_foreign_slice(foreign_load)
    from agent.daemon import Agent, AgentConfig
    from agent.isolation.cgroups.detect import detect
    from agent.isolation.cgroups.driver import KernelCgroups
    from agent.isolation.cgroups.reconcile import Reconciler
    from agent.topology import HostFS, discover

    topo = discover(HostFS("/"), use_cpuinfo_lib=False)
    online = topo.online_cpus()
    cpus = len(online)
    if cpus < 2:
        raise TidalError("bench cpu-isolation needs at least 2 online cpus")
    mounts = detect(HostFS("/"))
    driver = KernelCgroups(mounts, parent="self")
    if foreign_load == FOREIGN_CGROUP:
        check_foreign_cgroup(driver)
    base = f"tidal-bench-{uuid.uuid4().hex[:8]}"
    args = {"period_ms": period_ms, "work_us": work_us, "duration": duration}

    every = format_cpulist(online)
    mems = format_cpulist(n.id for n in topo.numa_nodes if n.cpus)

    def make_groups(run: _Run, online_group: str, offline_group: str, knobs: Dict[str, Dict[str, Any]]):
        """Make ``base/<group>`` cgroups with ``knobs`` (through the reconciler and its knob
        table, like the agent), put the probe and the hogs in, and return the clean-up."""
        specs = [CgroupSpec(base, {"cpus": every, "mems": mems})]
        specs += [CgroupSpec(f"{base}/{name}", {"cpus": every, "mems": mems, **extra}) for name, extra in knobs.items()]
        # v2 under a cgroup that is not the root (a delegated scope): this process leaves it for
        # <base>/system first, as the agent's own tree does (no internal processes)
        driver.prepare(base)
        report = Reconciler(driver, base).apply(specs)
        if report.failed:
            raise TidalError(f"bench cgroups: {report.failed[0][2]}")
        driver.move(f"{base}/{online_group}", run.probe.pid)
        for hog in run.hogs:
            driver.move(f"{base}/{offline_group}", hog.pid)
        return remove_bench_tree

    def remove_bench_tree() -> None:
        Reconciler(driver, base).revert()

    def none(run: _Run):
        return None

    def besteffort(run: _Run):
        return make_groups(run, "burstable", "besteffort",
                     {"burstable": {"cpu_shares": 1024}, "besteffort": {"cpu_shares": 2}})

    def static_split(run: _Run):
        return make_groups(run, "online", "offline", {"online": {"cpus": str(online[0])},
                                                "offline": {"cpus": format_cpulist(online[1:])}})

    def tidal(run: _Run, host_units: tuple = (), host_cgroups: tuple = (), foreign=None):
        state_dir = tempfile.mkdtemp(prefix="tidal-bench-")
        # the defaults a node runs with: the first core reserved for system work, where the agent
        # (here: this harness process and its agent thread) runs
        config = AgentConfig(socket_path=os.path.join(state_dir, "a.sock"), state_dir=state_dir,
                             cgroup_base=base, cgroup_parent="self", period=0.5, empty_grace=3600, confine_self=True,
                             host_units=host_units, cgroup_options=CgroupOptions(host_cgroups=host_cgroups))
        agent = Agent(config, echo=lambda line: None, topology=topo)
        agent.start()
        if foreign is not None:
            try:
                foreign.start()  # after the agent (that holds the slice where asked): as a host's work, there first or not
            except BaseException:
                foreign.stop()
                if agent.host_units is not None:
                    agent.host_units.release()
                agent.enforcement.reconciler.revert()
                shutil.rmtree(state_dir, ignore_errors=True)
                raise
        # the probe asks what it needs (a fifth of a cpu); offline asks all the capacity the agent reports
        agent.admit({"name": "probe", "qos": "shared_cores", "millicpu": 200})
        agent.admit({"name": "hogs", "qos": "reclaimed_cores", "millicpu": agent.state.reclaim_millicpu})
        agent.attach("probe", run.probe.pid)
        for hog in run.hogs:
            agent.attach("hogs", hog.pid)
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(config.period):
                agent.tick()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        for _ in range(4):  # the agent's steady state: a few periods of sampling and sizing
            agent.tick()
            time.sleep(config.period)

        def cleanup() -> None:
            stop.set()
            thread.join()
            if foreign is not None:
                foreign.stop()
            if agent.host_units is not None:
                agent.host_units.release()  # the slice's own cpus back, its saved value removed
            agent.enforcement.reconciler.revert()  # moves this process back to the parent cgroup too
            shutil.rmtree(state_dir, ignore_errors=True)  # the agent's state and socket: nothing left behind

        return cleanup

    foreign: Any = None
    held: Dict[str, tuple] = {}
    if foreign_load == FOREIGN_CGROUP:  # beside Tidal's tree (the same parent), held by the Reconciler
        foreign = CgroupForeignLoad(driver, f"tidal-bench-foreign-{uuid.uuid4().hex[:8]}", cpus, every, mems)
        held = {"host_cgroups": (foreign.path,)}
    elif foreign_load:  # a systemd slice, held through systemd
        foreign = ForeignLoad(foreign_load, cpus)
        held = {"host_units": (foreign_load,)}
    every_treatment = {"none": none, "besteffort": besteffort, "static_split": static_split, "tidal": tidal,
                       "tidal_foreign": lambda run: tidal(run, foreign=foreign),
                       "tidal_foreign_confined": lambda run: tidal(run, foreign=foreign, **held)}
    treatments = {name: every_treatment[name] for name in chosen}
    alone: List[Dict[str, Any]] = []
    results: Dict[str, List[Dict[str, Any]]] = {k: [] for k in treatments}
    try:
        if isinstance(foreign, CgroupForeignLoad) and any(name in FOREIGN_TREATMENTS for name in chosen):
            foreign.make()
        for _ in range(repeats):
            alone.append(_scenario("alone", cpus, args, none))
            for name, place in treatments.items():
                results[name].append(_scenario(name, cpus, args, place))
                if name in FOREIGN_TREATMENTS:
                    results[name][-1]["foreign_cpus"] = foreign.ran_on
    finally:
        if isinstance(foreign, CgroupForeignLoad):
            foreign.remove()
        elif foreign is not None:
            foreign.stop()
        remove_bench_tree()

    def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
        # latencies pooled over the repeats: the scenarios take turns in short slices,
        # so the host's noise bursts fall on all of them alike
        pooled = [x for r in rows for x in r["latencies_us"]]
        out = {"p50_us": round(percentile(pooled, 50), 1), "p99_us": round(percentile(pooled, 99), 1),
               "p999_us": round(percentile(pooled, 99.9), 1), "samples": len(pooled)}
        waits = [r["wait_us"] for r in rows if r["wait_us"] is not None]
        if waits:  # the probe's mean wait for a cpu per request, the median round's
            out["wait_us"] = round(median(waits), 1)
        ran_on = sorted({r["foreign_cpus"] for r in rows if "foreign_cpus" in r})
        if ran_on:  # where the foreign load ran (its cgroup's effective cpus; one value unless it changed)
            out["foreign_cpus"] = ran_on[0] if len(ran_on) == 1 else ran_on
        harvests = [r["offline_harvest"] for r in rows if r["offline_harvest"] is not None]
        if harvests:
            out["offline_harvest"] = round(median(harvests), 3)
        return out

    alone_summary = summary(alone)
    scenarios = {}
    for name, rows in results.items():
        scenarios[name] = summary(rows)
        scenarios[name]["p99_ratio"] = round(scenarios[name]["p99_us"] / alone_summary["p99_us"], 3)
    extra: Dict[str, Any] = {}
    if foreign is not None:
        where = {"cgroup": foreign.path} if isinstance(foreign, CgroupForeignLoad) else {"slice": foreign_load}
        extra["foreign_load"] = {**where, "processes": cpus, "duty": FOREIGN_DUTY, "period_ms": FOREIGN_PERIOD_MS}
    return {"alone": alone_summary, "scenarios": scenarios, **extra, "repeats": repeats, "cpus": cpus,
            "cgroup_version": driver.version, "kernel": os.uname().release, "duration_s": duration, "period_ms": period_ms, "work_us": work_us}


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe_main(float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                   *((float(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else ()))
    elif sys.argv[1] == "hog":
        hog_main()
    elif sys.argv[1] == "foreign":
        foreign_main(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), gate=sys.argv[5:6] == ["gate"])

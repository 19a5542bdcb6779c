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

Offline harvest = hogs' cpu time / the cpu time the probe left idle
(cpus x duration - probe cpu time). The scenarios take turns in short runs,
``repeats`` rounds of them; latency percentiles are over all rounds' samples
pooled, harvest is the median round's. Needs root (real cgroups); everything is created under this
process's own cgroups with unique names and removed afterwards.
"""

from __future__ import annotations

import json
import os
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
from agent.isolation.cgroups.desired import CgroupSpec
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
    print(json.dumps({"latencies_us": latencies, "cpu_s": time.process_time() - cpu0}), flush=True)


def hog_main() -> None:
    sys.stdin.readline()
    x = 0
    while True:
        x += 1


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
        return {"latencies_us": lat, "offline_harvest": hog_cpu / idle if self.hogs else None}

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


def run(duration: float = 2.0, repeats: int = 10, period_ms: float = 5.0, work_us: int = 300) -> Dict[str, Any]:
    if os.geteuid() != 0:
        raise TidalError("bench cpu-isolation needs root: it creates cgroups")
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
    base = f"tidal-bench-{uuid.uuid4().hex[:8]}"
    args = {"period_ms": period_ms, "work_us": work_us, "duration": duration}

    every = format_cpulist(online)
    mems = format_cpulist(n.id for n in topo.numa_nodes if n.cpus)

    def make_groups(run: _Run, online_group: str, offline_group: str, knobs: Dict[str, Dict[str, Any]]):
        """Make ``base/<group>`` cgroups with ``knobs`` (through the reconciler and its knob
        table, like the agent), put the probe and the hogs in, and return the clean-up."""
        specs = [CgroupSpec(base, {"cpus": every, "mems": mems})]
        specs += [CgroupSpec(f"{base}/{name}", {"cpus": every, "mems": mems, **extra}) for name, extra in knobs.items()]
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

    def tidal(run: _Run):
        state_dir = tempfile.mkdtemp(prefix="tidal-bench-")
        # the defaults a node runs with: the first core reserved for system work, where the agent
        # (here: this harness process and its agent thread) runs
        config = AgentConfig(socket_path=os.path.join(state_dir, "a.sock"), state_dir=state_dir,
                             cgroup_base=base, cgroup_parent="self", period=0.5, empty_grace=3600, confine_self=True)
        agent = Agent(config, echo=lambda line: None, topology=topo)
        agent.start()
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
            agent.enforcement.reconciler.revert()  # moves this process back to the parent cgroup too

        return cleanup

    treatments = {"none": none, "besteffort": besteffort, "static_split": static_split, "tidal": tidal}
    alone: List[Dict[str, Any]] = []
    results: Dict[str, List[Dict[str, Any]]] = {k: [] for k in treatments}
    try:
        for _ in range(repeats):
            alone.append(_scenario("alone", cpus, args, none))
            for name, place in treatments.items():
                results[name].append(_scenario(name, cpus, args, place))
    finally:
        remove_bench_tree()

    def summary(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
        # latencies pooled over the repeats: the scenarios take turns in short slices,
        # so the host's noise bursts fall on all of them alike
        pooled = [x for r in rows for x in r["latencies_us"]]
        out = {"p50_us": round(percentile(pooled, 50), 1), "p99_us": round(percentile(pooled, 99), 1),
               "p999_us": round(percentile(pooled, 99.9), 1), "samples": len(pooled)}
        harvests = [r["offline_harvest"] for r in rows if r["offline_harvest"] is not None]
        if harvests:
            out["offline_harvest"] = round(median(harvests), 3)
        return out

    alone_summary = summary(alone)
    scenarios = {}
    for name, rows in results.items():
        scenarios[name] = summary(rows)
        scenarios[name]["p99_ratio"] = round(scenarios[name]["p99_us"] / alone_summary["p99_us"], 3)
    return {"alone": alone_summary, "scenarios": scenarios, "repeats": repeats, "cpus": cpus,
            "cgroup_version": driver.version, "kernel": os.uname().release, "duration_s": duration, "period_ms": period_ms, "work_us": work_us}


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe_main(float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                   *((float(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else ()))
    elif sys.argv[1] == "hog":
        hog_main()

"""``tidal bench numa-usage``: how far the cgroup v2 per-cpu estimate is from v1's counters.

Online usage per NUMA node is busy time per cpu less what offline took on each
cpu. cgroup v1 counts the latter exactly (``cpuacct.usage_percpu``); cgroup v2
has no per-cpu counter, so the agent charges each offline thread's run time to
the cpu it last ran on (``agent.reporter.task_cpus``). This benchmark runs one
load on a v1 host and reads, every ``period`` seconds, the offline tree's
per-cpu time three ways:

* ``v1``: ``cpuacct.usage_percpu`` (the truth);
* ``task_attribution``: what the agent does on v2;
* ``even_split``: the naive answer (the tree's total spread evenly over its cpus).

The load: an online process bursting on the first cpu, and offline processes
(one per cpu plus one) that burst and sleep, so the scheduler moves them
between cpus. The error is per cpu, the finest grain (a NUMA node of one cpu),
in millicpu and relative to offline's total. Needs root and cgroup v1's cpuacct
(this project's host); everything is made under this process's cgroups with a
unique name and removed afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from typing import Any, Dict, List

from common.timing import median
from agent.errors import TidalError
from agent.isolation.cgroups.desired import CgroupSpec
from agent.reporter.task_cpus import TaskCpuAttribution, scale_to
from agent.topology.parse import format_cpulist


def burst_main(busy_ms: float, idle_ms: float) -> None:
    """A process that is busy ``busy_ms`` and sleeps ``idle_ms``, forever (killed by the harness)."""
    sys.stdin.readline()
    while True:
        end = time.perf_counter() + busy_ms / 1000
        x = 0
        while time.perf_counter() < end:
            x += 1
        time.sleep(idle_ms / 1000)


def _spawn(busy_ms: float, idle_ms: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agent.bench.numa_usage", str(busy_ms), str(idle_ms)],
                            stdin=subprocess.PIPE, text=True)


def _errors(estimates: List[Dict[int, float]], truths: List[Dict[int, float]], cpus: List[int]) -> Dict[str, Any]:
    per_sample_abs = []
    relative = []
    for est, truth in zip(estimates, truths):
        diffs = [abs(est.get(c, 0.0) - truth.get(c, 0.0)) for c in cpus]
        per_sample_abs.append(sum(diffs) / len(cpus))
        total = sum(truth.get(c, 0.0) for c in cpus)
        if total > 0:
            relative.append(sum(diffs) / total)
    return {"mean_abs_error_millicpu_per_cpu": round(sum(per_sample_abs) / max(1, len(per_sample_abs)), 1),
            "median_relative_error": round(median(relative), 4) if relative else None,
            "worst_relative_error": round(max(relative), 4) if relative else None}


def run(seconds: float = 20.0, period: float = 1.0) -> Dict[str, Any]:
    if os.geteuid() != 0:
        raise TidalError("bench numa-usage needs root: it creates cgroups")
    from agent.isolation.cgroups.detect import detect
    from agent.isolation.cgroups.driver import KernelCgroups
    from agent.isolation.cgroups.reconcile import Reconciler
    from agent.topology import HostFS, discover

    topo = discover(HostFS("/"), use_cpuinfo_lib=False)
    online = list(topo.online_cpus())
    if len(online) < 2:
        raise TidalError("bench numa-usage needs at least 2 online cpus")
    driver = KernelCgroups(detect(HostFS("/")), parent="self")
    if driver.version != 1 or "cpuacct" not in driver.bases:
        raise TidalError("bench numa-usage compares against cgroup v1's cpuacct.usage_percpu: run it on a v1 host")
    base = f"tidal-bench-{uuid.uuid4().hex[:8]}"
    mems = format_cpulist(n.id for n in topo.numa_nodes if n.cpus)
    offline_path = f"{base}/offline"
    reconciler = Reconciler(driver, base)
    procs: List[subprocess.Popen] = []
    try:
        report = reconciler.apply([CgroupSpec(base, {"cpus": format_cpulist(online), "mems": mems}),
                                   CgroupSpec(offline_path, {"cpus": format_cpulist(online), "mems": mems})])
        if report.failed:
            raise TidalError(f"bench cgroups: {report.failed[0][2]}")
        online_proc = _spawn(30, 30)
        procs.append(online_proc)
        os.sched_setaffinity(online_proc.pid, {online[0]})
        for i in range(len(online) + 1):
            proc = _spawn(20 + 10 * i, 10)
            procs.append(proc)
            driver.move(offline_path, proc.pid)
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        percpu = driver.percpu_reader(offline_path)
        total = driver.usage_reader(offline_path)
        tasks = TaskCpuAttribution(lambda: driver.procs(offline_path))
        samples: Dict[str, List[Dict[int, float]]] = {"v1": [], "task_attribution": [], "even_split": []}
        costs: List[float] = []
        time.sleep(0.5)
        last = (time.monotonic(), percpu(), total())
        tasks.sample()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(period)
            now, per, tot = time.monotonic(), percpu(), total()
            started = time.perf_counter()
            charged = tasks.sample()
            costs.append((time.perf_counter() - started) * 1000)
            elapsed = now - last[0]
            to_millicpu = 1000 / 1e9 / elapsed
            truth = {c: (per[c] - last[1][c]) * to_millicpu for c in online}
            whole = (tot - last[2]) * to_millicpu
            samples["v1"].append(truth)
            samples["task_attribution"].append(scale_to(charged, whole))
            samples["even_split"].append({c: whole / len(online) for c in online})
            last = (now, per, tot)
        truths = samples["v1"]
        attribution = _errors(samples["task_attribution"], truths, online)
        even = _errors(samples["even_split"], truths, online)
        ratio = None
        if attribution["mean_abs_error_millicpu_per_cpu"]:
            ratio = round(even["mean_abs_error_millicpu_per_cpu"] / attribution["mean_abs_error_millicpu_per_cpu"], 2)
        offline_total = [sum(t.values()) for t in truths]
        return {
            "benchmark": "numa-usage",
            "cgroup_version": driver.version,
            "kernel": os.uname().release,
            "cpus": len(online),
            "seconds": seconds,
            "period_s": period,
            "samples": len(truths),
            "offline_millicpu_median": round(median(offline_total), 1) if offline_total else None,
            "task_attribution": attribution,
            "even_split": even,
            "even_split_error_over_task_attribution": ratio,
            "attribution_cost_ms_median": round(median(costs), 3) if costs else None,
            "threads_sampled": len(procs) - 1,
        }
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        reconciler.revert()


if __name__ == "__main__":
    burst_main(float(sys.argv[1]), float(sys.argv[2]))

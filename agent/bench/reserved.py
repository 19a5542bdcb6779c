"""``tidal bench reserved``: may reclaimed work take the reserved cpus' idle time? Measured, both ways.

The reserved pool (``--reserved-cpus``, default the first core) runs the node's system work: the
agent, the kubelet, the runtime, journald. Reclaimed work runs at idle priority (``cpu.idle``), which
yields the cpu at once to anything runnable, but not while it is inside the kernel: a task in a system
call runs until it returns or sleeps. This benchmark puts kernel-heavy reclaimed work (each process
reads /dev/zero in 1 MiB blocks: nearly all its time is the kernel's copy) beside the node's system
work on the reserved cpus, and measures:

* a system daemon's latency: a probe in the system cgroup, on the reserved cpus, doing a fixed piece
  of work every ``period_ms`` (latency = tick to done, as ``bench cpu-isolation``'s probe);
* the agent's own answers: a real agent (in this process, confined to the reserved cpus as shipped)
  answering ``GET /v1/status`` every 20 ms, round trip measured;

in three treatments that take turns, ``repeats`` rounds of each:

* ``alone``: no reclaimed work;
* ``kept_off``: the reclaimed work on every cpu but the reserved ones (Tidal's rule);
* ``on_reserved``: the same work on every cpu, the reserved ones included (the rule before it).

Needs root (real cgroups); everything is made under this process's own cgroups with unique names and
removed afterwards.
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
from typing import Any, Dict, List

import psutil

from common.timing import median, percentile
from agent.errors import TidalError
from agent.isolation.cgroups.desired import CgroupSpec
from agent.topology.parse import format_cpulist


def kernel_hog_main() -> None:
    """Reclaimed work that lives in the kernel: /dev/zero read in 1 MiB blocks, for ever."""
    sys.stdin.readline()
    buffer = bytearray(1 << 20)
    with open("/dev/zero", "rb", buffering=0) as zero:
        while True:
            zero.readinto(buffer)


def run(duration: float = 3.0, repeats: int = 4, period_ms: float = 5.0, work_us: int = 300) -> Dict[str, Any]:
    if os.geteuid() != 0:
        raise TidalError("bench reserved needs root: it creates cgroups")
    from agent.client import AgentClient
    from agent.daemon import Agent, AgentConfig
    from agent.isolation.cgroups.detect import detect
    from agent.isolation.cgroups.driver import KernelCgroups
    from agent.isolation.cgroups.reconcile import Reconciler
    from agent.qrm.policy import default_reserved
    from agent.topology import HostFS, discover

    topo = discover(HostFS("/"), use_cpuinfo_lib=False)
    online = topo.online_cpus()
    reserved = default_reserved(topo)
    rest = [c for c in online if c not in reserved]
    if not reserved or not rest:
        raise TidalError("bench reserved needs at least 2 online cpus")
    mounts = detect(HostFS("/"))
    driver = KernelCgroups(mounts, parent="self")
    base = f"tidal-bench-{uuid.uuid4().hex[:8]}"
    mems = format_cpulist(n.id for n in topo.numa_nodes if n.cpus)
    state_dir = tempfile.mkdtemp(prefix="tidal-bench-")
    os.chmod(state_dir, 0o700)
    # the agent as shipped on such a node: the first core reserved, itself confined there; its tree under
    # the bench's own cgroup; no resize (nothing here is its to size)
    config = AgentConfig(socket_path=os.path.join(state_dir, "a.sock"), state_dir=state_dir,
                         cgroup_base=f"{base}/tidal", cgroup_parent="self", empty_grace=3600, confine_self=True,
                         resize=False)
    specs = [CgroupSpec(base, {"cpus": format_cpulist(online), "mems": mems}),
             CgroupSpec(f"{base}/system", {"cpus": format_cpulist(reserved), "mems": mems}),
             CgroupSpec(f"{base}/kept_off", {"cpus": format_cpulist(rest), "mems": mems, "cpu_idle": 1}),
             CgroupSpec(f"{base}/on_reserved", {"cpus": format_cpulist(online), "mems": mems, "cpu_idle": 1})]
    bench_tree = Reconciler(driver, base)
    report = bench_tree.apply(specs)
    if report.failed:
        bench_tree.revert()
        raise TidalError(f"bench cgroups: {report.failed[0][2]} (the idle-priority treatments need cpu.idle, "
                         f"Linux >= 5.15)")
    agent = Agent(config, echo=lambda line: None, topology=topo, driver=None)
    stop = threading.Event()
    try:
        agent.start()
        agent.serve()
        def loop() -> None:
            while not stop.wait(config.period):
                agent.tick()

        threading.Thread(target=loop, daemon=True).start()
        client = AgentClient(config.socket_path, timeout=10)
        rows: Dict[str, List[Dict[str, Any]]] = {"alone": [], "kept_off": [], "on_reserved": []}
        for _ in range(repeats):
            for treatment in rows:
                rows[treatment].append(_round(treatment, driver, base, client, len(online), duration,
                                              period_ms, work_us))
    finally:
        stop.set()
        if agent.state is not None:
            agent.shutdown()
            agent.enforcement.reconciler.revert()
        bench_tree.revert()
        shutil.rmtree(state_dir, ignore_errors=True)  # the agent's state and socket: nothing left behind

    def summary(rounds: List[Dict[str, Any]]) -> Dict[str, Any]:
        probe = [x for r in rounds for x in r["probe_us"]]
        api = [x for r in rounds for x in r["api_ms"]]
        return {"daemon_p50_us": round(percentile(probe, 50), 1), "daemon_p99_us": round(percentile(probe, 99), 1),
                "agent_p50_ms": round(percentile(api, 50), 2), "agent_p99_ms": round(percentile(api, 99), 2),
                "reclaimed_cpu_s": round(median([r["hog_cpu_s"] for r in rounds]), 2), "samples": len(probe)}

    out = {treatment: summary(rounds) for treatment, rounds in rows.items()}
    for treatment in ("kept_off", "on_reserved"):
        out[treatment]["daemon_p99_ratio"] = round(out[treatment]["daemon_p99_us"] / out["alone"]["daemon_p99_us"], 3)
        out[treatment]["agent_p99_ratio"] = round(out[treatment]["agent_p99_ms"] / out["alone"]["agent_p99_ms"], 3)
    return {"treatments": out, "reserved_cpus": format_cpulist(reserved), "cpus": len(online),
            "cgroup_version": driver.version, "kernel": os.uname().release, "repeats": repeats, "duration_s": duration,
            "period_ms": period_ms, "work_us": work_us}


def _round(treatment: str, driver, base: str, client, cpus: int, duration: float, period_ms: float,
           work_us: int) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "agent.bench.cpu_isolation", "probe", str(period_ms), str(work_us), str(duration)]
    probe = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hogs = [] if treatment == "alone" else [
        subprocess.Popen([sys.executable, "-m", "agent.bench.reserved", "hog"], stdin=subprocess.PIPE, text=True)
        for _ in range(cpus)]
    api_ms: List[float] = []
    try:
        if probe.stdout.readline().strip() != "ready":
            raise TidalError("the latency probe failed to start")
        driver.move(f"{base}/system", probe.pid)
        for hog in hogs:
            driver.move(f"{base}/{treatment}", hog.pid)
            hog.stdin.write("go\n")
            hog.stdin.flush()
        before = {h.pid: _cpu(h.pid) for h in hogs}
        probe.stdin.write("go\n")
        probe.stdin.flush()
        end = time.monotonic() + duration
        while time.monotonic() < end:
            start = time.perf_counter()
            client.request("GET", "/v1/status")
            api_ms.append((time.perf_counter() - start) * 1000)
            time.sleep(0.02)
        result = json.loads(probe.communicate(timeout=duration * 4 + 60)[0])
        hog_cpu = sum(_cpu(h.pid) - before[h.pid] for h in hogs)
        return {"probe_us": result["latencies_us"], "api_ms": api_ms, "hog_cpu_s": hog_cpu}
    finally:
        for proc in [probe, *hogs]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


if __name__ == "__main__":
    if sys.argv[1] == "hog":
        kernel_hog_main()

"""``tidal bench reaction``: from an online load step to online having its cores back.

The agent runs in-process on real cgroups with its default period (1 s) and
its fast guard (50 ms). An online ``shared_cores`` workload idles while the
agent lends the spare cpus; then it steps to one busy thread per cpu. The
time measured is from the step to the kernel showing the shared pool's
cpuset grown back over every cpu (the reclaim pool shrunk). Repeated
``steps`` times; p50/p99 reported.

The node keeps no reserved pool here (``--reserved-cpus none``): on a 2-cpu
machine that is the only way to have a cpu to lend and take back. The peak
window of the pool sizer is shortened to 3 periods so that lending resumes
between steps; it does not enter the measured path (taking back is
immediate, whatever the window).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List

from common.timing import median, percentile
from agent.errors import TidalError


def load_main() -> None:
    """A busy-loop that spins for the seconds each stdin line says."""
    for line in sys.stdin:
        end = time.perf_counter() + float(line)
        while time.perf_counter() < end:
            pass


def run(steps: int = 10, hold_s: float = 1.0, timeout_s: float = 5.0) -> Dict[str, Any]:
    if os.geteuid() != 0:
        raise TidalError("bench reaction needs root: it creates cgroups")
    from agent.daemon import Agent, AgentConfig
    from agent.topology import HostFS, discover
    from agent.topology.parse import parse_cpulist

    topo = discover(HostFS("/"), use_cpuinfo_lib=False)
    cpus = set(topo.online_cpus())
    if len(cpus) < 2:
        raise TidalError("bench reaction needs at least 2 online cpus")
    state_dir = tempfile.mkdtemp(prefix="tidal-reaction-")
    base = f"tidal-bench-{uuid.uuid4().hex[:8]}"
    config = AgentConfig(socket_path=os.path.join(state_dir, "a.sock"), state_dir=state_dir, reserved_cpus=(),
                         cgroup_base=base, cgroup_parent="self", empty_grace=3600)
    agent = Agent(config, echo=lambda line: None, topology=topo)
    agent.start()
    agent.harvest.sizer.window = 3
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(config.period):
            agent.tick()

    loads: List[subprocess.Popen] = []
    reactions: List[float] = []
    try:
        agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 500})
        for _ in cpus:
            proc = subprocess.Popen([sys.executable, "-m", "agent.bench.reaction", "load"], stdin=subprocess.PIPE,
                                    text=True)
            loads.append(proc)
            agent.attach("web", proc.pid)
        threading.Thread(target=loop, daemon=True).start()
        agent.start_guard()
        cpuset_file = os.path.join(agent.driver.where(f"{base}/shared")["cpuset" if agent.driver.version == 1
                                                                           else "unified"], "cpuset.cpus")

        def shared_cpus() -> set:
            with open(cpuset_file) as handle:
                return set(parse_cpulist(handle.read()))

        for _ in range(steps):
            deadline = time.monotonic() + 60
            while True:  # wait until the agent lends again, and still lends 0.5 s later
                while shared_cpus() == cpus:
                    if time.monotonic() > deadline:
                        raise TidalError("the agent did not lend cpus within 60 s")
                    time.sleep(0.05)
                time.sleep(0.5)
                if shared_cpus() != cpus:
                    break
            start = time.perf_counter()
            for proc in loads:
                proc.stdin.write(f"{hold_s}\n")
                proc.stdin.flush()
            while shared_cpus() != cpus:
                if time.perf_counter() - start > timeout_s:
                    break
                time.sleep(0.002)
            reactions.append((time.perf_counter() - start) * 1000.0)
            time.sleep(hold_s)
    finally:
        stop.set()
        agent.stop()
        for proc in loads:
            proc.kill()
            proc.wait()
        agent.enforcement.reconciler.revert()
        shutil.rmtree(state_dir, ignore_errors=True)  # the agent's state and socket: nothing left behind
    return {"cgroup_version": agent.driver.version, "kernel": os.uname().release,
            "p50_ms": round(median(reactions), 1), "p99_ms": round(percentile(reactions, 99), 1),
            "max_ms": round(max(reactions), 1), "steps": len(reactions), "period_s": config.period,
            "guard_interval_s": config.guard_interval, "fast_shrinks": agent.counters["fast_shrinks"],
            "reactions_ms": [round(r, 1) for r in reactions]}


if __name__ == "__main__":
    if sys.argv[1:] == ["load"]:
        load_main()

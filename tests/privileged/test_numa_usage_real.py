"""Per-cpu offline use on a real kernel, both hierarchies: v1's counters, v2's per-thread attribution.

The agent's per-NUMA online figure is per-cpu busy less what the reclaimed and dedicated trees took on
each cpu. v1 reads that from ``cpuacct.usage_percpu``; v2 has no per-cpu counter, and the agent charges
each offline thread's run time to the cpu it last ran on (``agent.reporter.task_cpus``). Here a hog in
an offline cgroup is pinned to one cpu, so where its time went is known.
"""

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from agent.daemon import Agent, AgentConfig
from agent.isolation.cgroups.desired import CgroupSpec
from agent.isolation.cgroups.detect import detect
from agent.isolation.cgroups.driver import KernelCgroups
from agent.isolation.cgroups.reconcile import Reconciler
from agent.reporter.task_cpus import TaskCpuAttribution, scale_to
from agent.topology import HostFS, discover
from agent.topology.parse import format_cpulist
from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]
TOPO = discover(HostFS("/"), use_cpuinfo_lib=False)
needs_two_cpus = pytest.mark.skipif(len(TOPO.online_cpus()) < 2, reason="needs at least 2 online cpus")
HOG = [sys.executable, "-c", "while True: pass"]


@needs_two_cpus
def test_a_pinned_offline_hog_is_charged_to_its_cpu():
    driver = KernelCgroups(detect(HostFS("/")), parent="self")
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    online = list(TOPO.online_cpus())
    every = {"cpus": format_cpulist(online), "mems": format_cpulist(n.id for n in TOPO.numa_nodes if n.cpus)}
    reconciler = Reconciler(driver, base)
    hog = subprocess.Popen(HOG)
    try:
        assert reconciler.apply([CgroupSpec(base, every), CgroupSpec(f"{base}/offline", every)]).ok
        driver.move(f"{base}/offline", hog.pid)
        target = online[-1]
        os.sched_setaffinity(hog.pid, {target})
        tasks = TaskCpuAttribution(lambda: driver.procs(f"{base}/offline"))
        total = driver.usage_reader(f"{base}/offline")
        tasks.sample()
        before, started = total(), time.monotonic()
        time.sleep(1.5)
        charged = tasks.sample()
        millicpu = (total() - before) / 1e9 / (time.monotonic() - started) * 1000
        per_cpu = scale_to(charged, millicpu)
        assert millicpu > 300  # the hog ran (a slow emulated cpu still gives it most of one cpu)
        assert set(per_cpu) == {target} and per_cpu[target] == pytest.approx(millicpu)
        if driver.version == 1:  # the v1 counter agrees on where the time went
            percpu = driver.percpu_reader(f"{base}/offline")()
            assert max(range(len(percpu)), key=lambda c: percpu[c]) == target
    finally:
        hog.kill()
        hog.wait()
        reconciler.revert()
    assert not driver.exists(base)


@needs_two_cpus
def test_the_agent_knows_online_use_per_numa_node_on_either_hierarchy(tmp_path):
    """The agent's estimator receives per-node online figures (v1: counters, v2: attribution) with
    reclaimed work running; without them NUMA capacity would fall back to a share of the node total."""
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    config = AgentConfig(socket_path=str(tmp_path / "a.sock"), state_dir=str(tmp_path / "st"), reserved_cpus=(),
                         cgroup_base=base, cgroup_parent="self", empty_grace=3600, period=0.5)
    agent = Agent(config, echo=lambda line: None, topology=TOPO)
    agent.start()
    stop = threading.Event()
    hog = subprocess.Popen(HOG)

    def loop():
        while not stop.wait(config.period):
            agent.tick()

    ticker = threading.Thread(target=loop, daemon=True)
    try:
        agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 1000, "tier": "low"})
        agent.attach("batch", hog.pid)
        ticker.start()
        deadline = time.monotonic() + 30
        while agent.harvest.estimator.node_demand(time.monotonic()) is None:
            assert time.monotonic() < deadline, "no per-NUMA online figure"
            time.sleep(0.1)
        nodes = agent.harvest.estimator.node_demand(time.monotonic())
        assert set(nodes) == {n.id for n in TOPO.numa_nodes if n.cpus}
    finally:
        stop.set()
        if ticker.is_alive():  # a period mid-way would make the tree again after the revert
            ticker.join()
        hog.kill()
        hog.wait()
        agent.shutdown()
        Reconciler(agent.driver, base).revert()
    assert not agent.driver.exists(base)

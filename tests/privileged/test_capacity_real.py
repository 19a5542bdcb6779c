"""End to end on real cgroups: online load rises -> the reclaim pool shrinks in the kernel,
the capacity API drops within one period, a long-poller wakes, low-tier work dies first."""

import subprocess
import sys
import threading
import time
import uuid

import pytest

from agent.client import AgentClient
from agent.daemon import Agent, AgentConfig
from agent.isolation.cgroups.reconcile import Reconciler
from agent.topology import HostFS, discover
from agent.topology.parse import parse_cpulist
from tests.conftest import cpuset_dir, privileged

pytestmark = [pytest.mark.privileged, privileged]
TOPO = discover(HostFS("/"), use_cpuinfo_lib=False)
HOG = [sys.executable, "-c", "while True: pass"]
WAITING_HOG = [sys.executable, "-c", "import sys; sys.stdin.readline()\nwhile True: pass"]


@pytest.mark.skipif(len(TOPO.online_cpus()) < 2, reason="needs at least 2 online cpus")
def test_online_load_shrinks_lending_and_evicts_low_first(tmp_path):
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"
    config = AgentConfig(api_poll_interval=0.05, socket_path=str(tmp_path / "a.sock"), state_dir=str(tmp_path / "st"),
                         reserved_cpus=(), cgroup_base=base, cgroup_parent="self", empty_grace=3600,
                         eviction_grace=1.0, period=1.0)
    agent = Agent(config, echo=lambda line: None, topology=TOPO)
    agent.start()
    agent.harvest.sizer.stable_periods = 1
    agent.serve()
    stop = threading.Event()
    procs = []

    def loop():
        while not stop.wait(config.period):
            agent.tick()

    ticker = threading.Thread(target=loop, daemon=True)
    try:
        agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 500})
        online = subprocess.Popen(WAITING_HOG, stdin=subprocess.PIPE, text=True)
        procs.append(online)
        agent.attach("web", online.pid)
        offline = {}
        for tier in ("high", "min", "low"):
            agent.admit({"name": f"batch-{tier}", "qos": "reclaimed_cores", "millicpu": 300, "tier": tier})
            offline[tier] = subprocess.Popen(HOG)
            procs.append(offline[tier])
            agent.attach(f"batch-{tier}", offline[tier].pid)
        ticker.start()
        agent.start_guard()
        client = AgentClient(config.socket_path, timeout=30)
        shared_file = cpuset_dir(agent.driver, f"{base}/shared")
        shared_cpus = lambda: set(parse_cpulist(open(f"{shared_file}/cpuset.cpus").read()))  # noqa: E731
        deadline = time.monotonic() + 20
        while shared_cpus() == set(TOPO.online_cpus()):  # the agent lends a cpu while online idles
            assert time.monotonic() < deadline, "no cpu was lent"
            time.sleep(0.1)
        before = client.request("GET", "/v1/capacity")
        assert before["reclaimed"]["millicpu"] >= 1000

        woken = {}

        def long_poll():
            doc = client.request("GET", f"/v1/capacity?wait_generation={before['generation']}&timeout=20")
            woken["at"], woken["doc"] = time.monotonic(), doc

        poller = threading.Thread(target=long_poll)
        poller.start()
        time.sleep(0.2)
        step = time.monotonic()
        online.stdin.write("go\n")  # online load rises: one cpu busy
        online.stdin.flush()
        while shared_cpus() != set(TOPO.online_cpus()):
            assert time.monotonic() - step < 5, "the reclaim pool did not shrink"
            time.sleep(0.005)
        shrunk_after = time.monotonic() - step
        poller.join(timeout=20)
        assert woken, "the long-poller was not woken"
        # woken by the drop, not by its 20 s timeout: the same 5 s bound as the shrink above. How
        # fast (one period or less on the host, more under the VM tier's emulation) is a figure
        # `tidal bench reaction` measures on both hierarchies, not something a timed test asserts.
        woke_after = woken["at"] - step
        print(f"shrunk after {shrunk_after:.3f} s, long-poller woken after {woke_after:.3f} s")
        assert woke_after < 5
        assert woken["doc"]["generation"] > before["generation"]
        assert woken["doc"]["reclaimed"]["millicpu"] < before["reclaimed"]["millicpu"]
        deadline = time.monotonic() + 10
        while not agent.eviction.evictions and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2 * config.period)  # the rest of the eviction pass, if it takes more than one
        # evicted by tier, low first, until what is left fits the quota the kernel enforced when the pass
        # decided (the unrounded capacity: work that fits it is throttled, not evicted). The quota read
        # now may have moved since (online use is measured again every period; the VM's was 806 at the
        # eviction and 459 two periods later); a lower one is a later pass's business, after its grace.
        tiers = [e["tier"] for e in agent.eviction.evictions]
        assert tiers and tiers == ["low", "min", "high"][:len(tiers)], tiers
        assert all(e["cause"] == "cpu" for e in agent.eviction.evictions)
        left = [t for t in ("low", "min", "high") if t not in tiers]
        seen = agent.eviction.evictions[-1]["capacity_millicpu"]
        assert 300 * len(left) <= seen, (tiers, seen)
        assert 300 * (len(left) + 1) > seen, (tiers, seen)  # and no more than that: one fewer would not fit
        for tier in tiers:
            offline[tier].wait(timeout=5)  # killed
            assert offline[tier].returncode == -9
        assert all(offline[t].poll() is None for t in left)  # the rest run on, throttled
        assert online.poll() is None  # online untouched
        assert agent.eviction.by_tier == {t: int(t in tiers) for t in ("low", "min", "high")}
    finally:
        stop.set()
        if ticker.is_alive():  # a period mid-way would make the tree again after the revert
            ticker.join()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        agent.shutdown()
        Reconciler(agent.driver, base).revert()
        assert not agent.driver.exists(base)


def test_lending_round_trip_on_real_cgroups_across_a_restart(tmp_path):
    """Lend, run offline work on the lent machine, take it back with a notice that spans an
    agent restart: the offline process lives until the deadline and is killed then."""
    base = f"tidal-test-{uuid.uuid4().hex[:8]}"

    def make(name):
        config = AgentConfig(api_poll_interval=0.05, socket_path=str(tmp_path / f"{name}.sock"),
                             state_dir=str(tmp_path / "st"), cgroup_base=base, cgroup_parent="self",
                             empty_grace=3600, guard_interval=0)
        agent = Agent(config, echo=lambda line: None, topology=TOPO)
        agent.start()
        return agent

    first = make("a")
    offline = None
    second = None
    try:
        first.lend(0)
        first.tick()
        assert first.lending.current.state == "Offline"
        first.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 1000})
        offline = subprocess.Popen(HOG)
        first.attach("batch", offline.pid)
        first.take_back("3s")
        deadline = first.lending.current.deadline
        assert first.capacity_doc()["target"] == {"millicpu": 0, "memory_bytes": 0}
        first.shutdown()  # the agent stops in the middle of the notice window
        time.sleep(0.5)
        assert offline.poll() is None
        second = make("b")
        assert second.lending.current.state == "OfflineToOnline" and second.lending.current.deadline == deadline
        second.tick()
        assert offline.poll() is None  # the notice is honoured after the restart
        time.sleep(max(0.0, deadline - time.time()) + 0.1)
        second.tick()
        offline.wait(timeout=5)
        assert offline.returncode == -9 and second.lending.current.state == "Online"
        assert time.time() >= deadline
    finally:
        if offline is not None and offline.poll() is None:
            offline.kill()
            offline.wait()
        agent = second or first
        agent.shutdown()
        Reconciler(agent.driver, base).revert()

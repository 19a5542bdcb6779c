"""Traffic shaping on real veth "NICs" in network namespaces the tests make.

Each test builds a host namespace with two NICs into a peer namespace
(198.18.0.0/15 only, see ``agent.bench.netlab``), runs a real agent on the
host's cgroups (under the test's own cgroup, unique base) with
``--net-netns``, and sends real TCP traffic between the namespaces.
"""

import json
import shutil
import time
import uuid

import pytest

from agent.bench.netlab import SERVICE, NetLab
from agent.daemon import Agent, AgentConfig
from agent.isolation.cgroups.detect import detect
from agent.isolation.cgroups.driver import KernelCgroups
from agent.isolation.cgroups.reconcile import Reconciler
from agent.isolation.net.policy import NetConfig, NetError, NicRole, parse_nic
from agent.isolation.net.shaper import DEADBAND, NetShaper
from agent.topology import HostFS
from tests.conftest import privileged

MBIT = 1_000_000
needs_tools = pytest.mark.skipif(not (shutil.which("nft") and shutil.which("nsenter") and shutil.which("tc")),
                                 reason="needs nft (nftables), nsenter (util-linux) and tc (iproute2)")
pytestmark = [pytest.mark.privileged, privileged, needs_tools]


@pytest.fixture()
def lab():
    with NetLab(dual=True) as made:
        yield made


@pytest.fixture()
def base():
    name = f"tidal-test-{uuid.uuid4().hex[:8]}"
    yield name
    driver = KernelCgroups(detect(HostFS("/")), parent="self")
    Reconciler(driver, name).revert()


def start_agent(tmp_path, base, net: NetConfig) -> Agent:
    config = AgentConfig(api_poll_interval=0.05, socket_path=str(tmp_path / "a.sock"),
                         state_dir=str(tmp_path / "state"), reserved_cpus=(), cgroup_base=base,
                         cgroup_parent="self", empty_grace=3600, resize=False, drift_check_period=0,
                         watch_period=0, net=net)
    agent = Agent(config, echo=lambda line: None)
    agent.start()
    if agent.net.classifier.kind == "none":
        agent.shutdown()
        pytest.skip(f"no cgroup classifier on this host: {agent.net.classifier.reason}")
    return agent


def offline_send(lab: NetLab, agent: Agent, name: str, seconds: float) -> dict:
    """A sender attached to reclaimed workload ``name`` before it opens its socket."""
    proc = lab.spawn(lab.host, ["send", SERVICE, "5001", str(seconds), "--wait"], stdin=True)
    agent.attach(name, proc.pid)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=seconds + 20)
    assert proc.returncode == 0, err
    return json.loads(out)


def online_send(lab: NetLab, seconds: float) -> dict:
    proc = lab.spawn(lab.host, ["send", SERVICE, "5001", str(seconds)])
    out, err = proc.communicate(timeout=seconds + 20)
    assert proc.returncode == 0, err
    return json.loads(out)


def classes(agent: Agent, nic: str, side: str = "egress") -> dict:
    entry = next(n for n in agent.net_status()["nics"] if n["name"] == nic)
    return entry[side]["classes"]


def test_offline_process_is_counted_in_the_offline_class_and_capped(lab, base, tmp_path):
    net = NetConfig(NicRole("a0", 100 * MBIT), netns=lab.host)
    agent = start_agent(tmp_path, base, net)
    try:
        agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 500, "tier": "low"})
        lab.server(lab.peer, ["sink", SERVICE, "5001"])
        before = classes(agent, "a0")
        off = offline_send(lab, agent, "batch", 2.0)
        mid = classes(agent, "a0")
        on = online_send(lab, 2.0)
        after = classes(agent, "a0")
        ceil = mid["offline"]["ceil_bps"]
        # the offline sender's bytes are in the offline class, not the online one
        assert mid["offline"]["bytes"] - before["offline"]["bytes"] >= 0.95 * off["bytes"]
        assert mid["online"]["bytes"] - before["online"]["bytes"] < 0.02 * off["bytes"]
        # ... and it ran at its ceiling (a veth alone carries gigabits)
        assert off["mbps"] * MBIT <= ceil * 1.08, (off, ceil)
        assert off["mbps"] * MBIT >= ceil * 0.7, (off, ceil)
        # the online sender is not counted as offline
        assert after["offline"]["bytes"] - mid["offline"]["bytes"] < 0.02 * on["bytes"]
        assert after["online"]["bytes"] - mid["online"]["bytes"] >= 0.95 * on["bytes"]
        # its replies (ACKs to ports 61440-65535, the NAT's range for offline) are offline on ingress
        ingress = classes(agent, "a0", "ingress")
        assert ingress["offline"]["packets"] > 100
    finally:
        agent.shutdown()


def test_offline_ceiling_floats_down_under_online_load_and_back(lab, base, tmp_path):
    net = NetConfig(NicRole("a0", 100 * MBIT), netns=lab.host, window=1.0)
    agent = start_agent(tmp_path, base, net)
    try:
        lab.server(lab.peer, ["sink", SERVICE, "5001"])
        idle_ceil = classes(agent, "a0")["offline"]["ceil_bps"]
        flood = lab.spawn(lab.host, ["send", SERVICE, "5001", "3"])
        lowest = idle_ceil
        # sampled for as long as the sender runs: its 3 s of flood begin after its interpreter's start,
        # which under the v2 tier's emulation once took longer than the 3 s this loop used to last
        deadline = time.monotonic() + 3 + 30
        while flood.poll() is None:
            assert time.monotonic() < deadline, "the online flood did not end in 33 s"
            agent.net.adjust()
            lowest = min(lowest, classes(agent, "a0")["offline"]["ceil_bps"])
            time.sleep(0.25)
        out, err = flood.communicate(timeout=20)
        assert flood.returncode == 0, err
        online_bps = json.loads(out)["mbps"] * MBIT
        floor = int(100 * MBIT * net.offline_floor)
        shaped = int(100 * MBIT * (1 - net.headroom))
        assert idle_ceil >= 90 * MBIT
        assert online_bps >= 60 * MBIT, out  # online took most of the link
        # offline's ceiling came down to what online left it: the shaped rate less online's peak (no less
        # than its mean rate over the flood) and the margin, or the floor. Not the floor alone: a sender
        # under the v2 tier's emulation once reached only 91 of the 98 Mbit/s shaped, leaving 5.7 Mbit/s.
        # And within the deadband of it: the agent leaves a ceiling where it is while its target moves by less
        # than DEADBAND of the link (CI, 2026-11-30: 5.87 Mbit/s held against a target of 5.0 reached from it)
        left = max(floor, shaped - online_bps - 100 * MBIT * net.margin)
        assert lowest <= left * 1.1 + DEADBAND * 100 * MBIT, (lowest, left, online_bps)
        for _ in range(8):  # the last flood sample ages out of the 1 s window
            agent.net.adjust()
            time.sleep(0.3)
        assert classes(agent, "a0")["offline"]["ceil_bps"] >= 90 * MBIT  # and gets it back when online stops
        assert agent.net.rerates >= 2
    finally:
        agent.shutdown()


def test_offline_traffic_takes_the_offline_nic_and_falls_back_when_it_is_down(lab, base, tmp_path):
    net = NetConfig(NicRole("a0", 100 * MBIT), NicRole("b0", 100 * MBIT, gateway="198.18.2.2"), netns=lab.host)
    agent = start_agent(tmp_path, base, net)
    try:
        agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 500, "tier": "low"})
        lab.server(lab.peer, ["sink", SERVICE, "5001"])

        def offline_bytes():
            return {nic: classes(agent, nic)["offline"]["bytes"] for nic in ("a0", "b0")}

        start = offline_bytes()
        sent = offline_send(lab, agent, "batch", 1.0)["bytes"]
        both_up = offline_bytes()
        assert both_up["b0"] - start["b0"] >= 0.95 * sent
        assert both_up["a0"] - start["a0"] < 0.02 * sent
        assert agent.net_status()["offline_via"] == "b0"

        lab.link(lab.peer, "b1", up=False)  # the offline NIC loses its carrier
        time.sleep(0.2)
        agent.net.adjust()
        assert agent.net_status()["offline_via"].startswith("a0 (fallback")
        sent = offline_send(lab, agent, "batch", 1.0)["bytes"]
        fallback = offline_bytes()
        assert fallback["a0"] - both_up["a0"] >= 0.95 * sent  # on the online NIC, in its offline class
        assert fallback["b0"] - both_up["b0"] < 0.02 * sent

        lab.link(lab.peer, "b1", up=True)
        time.sleep(0.5)
        agent.net.adjust()
        assert agent.net_status()["offline_via"] == "b0"
        sent = offline_send(lab, agent, "batch", 1.0)["bytes"]
        back = offline_bytes()
        assert back["b0"] - fallback["b0"] >= 0.95 * sent
        assert agent.net.failovers == 2
    finally:
        agent.shutdown()


def test_clean_shutdown_leaves_no_trace_and_a_restart_adopts(lab, base, tmp_path):
    before = lab.listing()
    net = NetConfig(NicRole("a0", 100 * MBIT), NicRole("b0", 100 * MBIT, gateway="198.18.2.2"), netns=lab.host)
    agent = start_agent(tmp_path, base, net)
    built = lab.listing()
    assert built != before and "1a1d" in built["qdiscs"] and "proto 211" in built["rules"]
    # a crash leaves the set-up; the next start adopts it rather than adding a second copy
    agent.net.nl.close()
    agent.net.nl = None
    agent.net = None
    agent.shutdown()
    again = NetShaper(net, agent.driver.membership_dir(f"{base}/reclaimed"), None, detect(HostFS("/")).unified)
    again.setup()
    adopted = lab.listing()
    assert adopted["rules"].count("proto 211") == 1
    assert adopted["nft"].count("table inet tidal") == 1
    assert adopted["filters a0"].count("pref 6685") == built["filters a0"].count("pref 6685")
    assert adopted["qdiscs"] == built["qdiscs"]
    again.revert()
    assert lab.listing() == before


@pytest.mark.parametrize("online, offline, message", [
    (NicRole("nosuch0", 100 * MBIT), None, "NIC 'nosuch0' does not exist"),
    (NicRole("a0", 100 * MBIT), NicRole("nosuch1", 100 * MBIT), "NIC 'nosuch1' does not exist"),
    (NicRole("a0", 400_000 * MBIT), None, "above its link speed"),
    (NicRole("a0", 100 * MBIT), NicRole("a0", 100 * MBIT), "both the online and the offline role"),
], ids=["missing-online", "missing-offline", "rate-above-link", "overlapping-roles"])
def test_bad_nics_are_clear_errors_and_build_nothing(lab, online, offline, message):
    before = lab.listing()
    shaper = NetShaper(NetConfig(online, offline, netns=lab.host))
    with pytest.raises(NetError, match=message):
        shaper.setup()
    assert lab.listing() == before


def test_zero_rate_is_refused_before_anything_is_built():
    with pytest.raises(NetError, match="must be above zero"):
        parse_nic("a0:0mbit")


def test_a_foreign_root_qdisc_is_refused_not_replaced(lab):
    import subprocess

    subprocess.run(["ip", "netns", "exec", lab.host, "tc", "qdisc", "add", "dev", "a0", "root", "handle", "5:",
                    "tbf", "rate", "10mbit", "burst", "4kb", "limit", "10kb"], check=True)
    before = lab.listing()
    with pytest.raises(NetError, match="root qdisc .*Tidal did not make"):
        NetShaper(NetConfig(NicRole("a0", 100 * MBIT), netns=lab.host)).setup()
    assert lab.listing() == before


def test_tidal_agent_with_nics_serves_net_status_and_cleans_up_on_sigterm(lab, base, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    before = lab.listing()
    sock = str(tmp_path / "n.sock")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "agent", "--socket", sock, "--state-dir", str(tmp_path / "s"),
         "--reserved-cpus", "none", "--cgroup-base", base, "--cgroup-parent", "self", "--no-confine-self",
         "--online-nic", "a0:100mbit", "--offline-nic", "b0:100mbit", "--offline-gateway", "198.18.2.2",
         "--net-netns", lab.host], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in agent.stdout:
            if "serving" in line:
                break
        else:
            raise AssertionError("agent did not start")
        status = subprocess.run([sys.executable, "-m", "agent.cli", "net", "status", "--socket", sock, "--json"],
                                capture_output=True, text=True, check=True)
        data = json.loads(status.stdout)
        assert data["enabled"] and [n["name"] for n in data["nics"]] == ["a0", "b0"]
        assert data["classifier"] in ("nft-cgroupv2", "none")
        if data["classifier"] != "none":
            assert data["offline_via"] == "b0"
        table = subprocess.run([sys.executable, "-m", "agent.cli", "net", "status", "--socket", sock],
                               capture_output=True, text=True, check=True).stdout
        assert "a0 (online, 100mbit, up)" in table and "offline" in table
    finally:
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=30)
    assert agent.returncode == 0, out
    assert "network shaping removed" in out
    assert lab.listing() == before


def test_agent_refuses_to_start_on_a_missing_nic_with_one_line(lab, base, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "agent", "--socket", str(tmp_path / "m.sock"), "--state-dir",
         str(tmp_path / "s"), "--reserved-cpus", "none", "--cgroup-base", base, "--cgroup-parent", "self",
         "--no-confine-self", "--online-nic", "eth9:1gbit", "--net-netns", lab.host],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"tidal: error: NIC 'eth9' does not exist in network namespace {lab.host!r}"

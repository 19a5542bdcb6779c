"""What is not online demand, on real cgroups, with the agent as shipped (the CLI, default timings):
a cgroup declared with --offline-cgroup, and Tidal's own helpers (a push command that burns a cpu).
Without either, that cpu would become the online peak and cut the capacity offline systems are told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from agent.client import AgentClient
from tests.conftest import privileged, terminate
from tests.offline_cgroup import OfflineCgroup

pytestmark = [pytest.mark.privileged, privileged]
BURN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


def start_agent(tmp_path, base, *args):
    sock = str(tmp_path / "a.sock")
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--socket", sock, "--state-dir",
                              str(tmp_path / "state"), "--cgroup-base", base, "--revert", *args],
                             stdout=log, stderr=subprocess.STDOUT)
    log.close()
    client = AgentClient(sock, timeout=15)
    deadline = time.monotonic() + 60
    while not (os.path.exists(sock) and client.call("GET", "/v1/health")[0] == 200):
        assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "agent.log").read_text()
        time.sleep(0.1)
    return agent, client


def online_while(client, proc, seconds):
    """The highest online and per-offline-cgroup figures the agent reported while ``proc`` ran."""
    peak, declared = 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        status = client.request("GET", "/v1/status")
        peak = max(peak, status["online_millicpu"])
        declared = max([declared] + [c["millicpu"] or 0 for c in status["offline_cgroups"]])
        time.sleep(0.25)
    return peak, declared


def test_a_declared_offline_cgroup_is_not_online_demand(tmp_path):
    uid = uuid.uuid4().hex[:8]
    offline = OfflineCgroup(f"tidal-offline-test-{uid}")
    agent, client = start_agent(tmp_path, f"tidal-test-{uid}", "--offline-cgroup", f"/{offline.name}/")
    try:
        time.sleep(3)  # the agent's own start is behind its samples
        hog = subprocess.Popen(offline.wrap([sys.executable, "-c", BURN.format(s=6)]))
        inside = online_while(client, hog, 6)
        hog.wait()
        time.sleep(1.5)
        hog = subprocess.Popen([sys.executable, "-c", BURN.format(s=6)])  # the same work, undeclared
        outside = online_while(client, hog, 6)
        hog.wait()
    finally:
        terminate(agent)
        offline.remove()
    print(json.dumps({"declared_offline": {"online_peak": inside[0], "offline_cgroup": inside[1]},
                      "undeclared": {"online_peak": outside[0]}}))
    assert inside[1] >= 700, "the declared cgroup's busy cpu was not seen"
    assert inside[0] < 500, f"a declared offline cgroup's cpu counted as online ({inside[0]} millicpu)"
    assert outside[0] >= 700, "the same work outside it should be online (the test's control)"


def test_a_push_command_runs_in_the_helpers_cgroup_and_is_not_online(tmp_path):
    uid = uuid.uuid4().hex[:8]
    base = f"tidal-test-{uid}"
    marker = tmp_path / "push.cgroup"
    script = tmp_path / "push.py"  # a heavy push command (a JVM's start, say): 2 s of a busy cpu
    script.write_text(BURN.format(s=2) + f"open({str(marker)!r}, 'w').write(open('/proc/self/cgroup').read())\n")
    agent, client = start_agent(tmp_path, base, "--push-command", json.dumps([sys.executable, str(script)]))
    try:
        deadline = time.monotonic() + 30
        peak = 0
        while not marker.exists():  # the first push comes with the first capacity
            assert time.monotonic() < deadline, "the push command never ran"
            peak = max(peak, client.request("GET", "/v1/status")["online_millicpu"])
            time.sleep(0.25)
        time.sleep(1.5)
        peak = max(peak, client.request("GET", "/v1/status")["online_millicpu"])
        push = [p for p in client.request("GET", "/v1/status")["push"] if p["kind"] == "command"][0]
    finally:
        terminate(agent)
    lines = marker.read_text().splitlines()
    print(json.dumps({"push_cgroups": lines, "online_peak_during_push": peak}))
    assert all(line.rstrip("/").endswith(f"{base}/helpers") for line in lines if line.split(":")[1] in
               ("", "cpuacct", "cpu,cpuacct", "cpuacct,cpu", "memory")), lines
    assert push["sent"] >= 1 and push["consecutive_failures"] == 0
    assert peak < 500, f"the push command's cpu counted as online ({peak} millicpu)"

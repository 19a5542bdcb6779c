"""`tidal agent` as a process: starts on a tree, says where things are, serves, stops on SIGTERM."""

import signal
import subprocess
import sys

from agent.client import AgentClient
from agent.topology.synthetic import Shape, write_tree


def test_agent_starts_serves_and_stops_cleanly(tmp_path):
    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    sock = tmp_path / "t.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"), "--cgroups-in-memory",
         "--socket", str(sock), "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        notice = proc.stdout.readline()  # the test-only switch says what it turns off
        assert "cgroups in memory (--cgroups-in-memory)" in notice and "the fast guard" in notice, notice
        first = proc.stdout.readline()
        second = proc.stdout.readline()
        assert "1 sockets, 1 NUMA nodes, 2 cores, 4 cpus" in first, first + second
        assert f"serving {sock}" in second and str(tmp_path / "state" / "checkpoint.json") in second
        assert AgentClient(str(sock)).request("GET", "/v1/health") == {"ok": True}
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "stopped" in out
    assert not sock.exists()

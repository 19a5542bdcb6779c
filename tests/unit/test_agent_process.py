"""`tidal agent` as a process: starts on a tree, says where things are, stops on SIGTERM."""

import os
import signal
import subprocess
import sys
import time

from agent.topology.synthetic import Shape, write_tree


def test_agent_starts_and_stops_cleanly(tmp_path):
    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
         "--socket", str(tmp_path / "t.sock"), "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        second = proc.stdout.readline()
        assert "1 sockets, 1 NUMA nodes, 2 cores, 4 cpus" in first
        assert str(tmp_path / "t.sock") in second and str(tmp_path / "state") in second
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "stopped" in out

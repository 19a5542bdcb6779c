"""`tidal bench overhead` as shipped (root, real cgroups: v1 here, v2 in the VM tier): it waits for the
agent's steady state and says so, and its figures are the agent's own (a benchmark: no figure is held to a
target here; docs/benchmarks has them)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]


def test_bench_overhead_measures_a_settled_agent_and_cleans_up(tmp_path):
    # TMPDIR: where the bench's agent keeps its state and socket, to find what it leaves there
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "bench", "overhead", "--workloads", "8", "--seconds", "5"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    print(result)
    assert result["workloads"] == 8 and result["seconds"] >= 5
    assert result["settled"] is True and result["settle_s"] >= 5  # 5 s without a pass over the tree, at least
    assert 0 < result["cpu_percent"] < 100 and 10 < result["rss_mib"] < 1024
    # the agent ran with --revert: its tree (under this process's own cgroups) is gone
    leftovers = subprocess.run(["find", "/sys/fs/cgroup", "-type", "d", "-name", "tidal-bench-*"],
                               capture_output=True, text=True)
    assert leftovers.stdout == ""
    assert os.listdir(tmp_path) == []  # nor its state directory

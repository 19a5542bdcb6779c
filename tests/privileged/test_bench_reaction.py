"""`tidal bench reaction` as shipped (root, real cgroups: v1 here, v2 in the VM tier): each step is timed to the
kernel showing online's cpus back, and the bench leaves nothing behind (a benchmark: its figures are not held to
a target here; docs/benchmarks has them)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]


def test_bench_reaction_times_each_step_and_leaves_nothing(tmp_path):
    before = {d for d, _, _ in os.walk("/sys/fs/cgroup") if os.path.basename(d).startswith("tidal-bench-")}
    # TMPDIR: where the bench's agent keeps its state and socket, to find what it leaves there
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "bench", "reaction", "--steps", "2", "--json"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    print(result)
    assert result["steps"] == 2
    assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    assert result["guard_interval_s"] > 0
    after = {d for d, _, _ in os.walk("/sys/fs/cgroup") if os.path.basename(d).startswith("tidal-bench-")}
    assert after == before
    assert os.listdir(tmp_path) == []

"""``tidal bench cpu-isolation`` as a user runs it, short: the treatments asked for and no others, the probe's
wait for a cpu by the kernel's count, the refusals of what cannot run here, and nothing left behind.
(The foreign-load rows need systemd as PID 1: tests/systemd/test_bench_foreign_load.py, make test-systemd.)"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]
TIDAL = [sys.executable, "-m", "agent.cli"]


def _cgroups_named(prefix: str):
    return {d for d, _, _ in os.walk("/sys/fs/cgroup") if os.path.basename(d).startswith(prefix)}


def test_the_treatments_asked_for_with_the_probes_wait():
    before = _cgroups_named("tidal-bench-")
    proc = subprocess.run(TIDAL + ["bench", "cpu-isolation", "--treatments", "none,tidal", "--repeats", "2",
                                   "--duration", "0.5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = report["scenarios"]
    assert list(rows) == ["none", "tidal"] and "foreign_load" not in report
    for row in [report["alone"], *rows.values()]:
        assert row["samples"] >= 2 * 90 and row["wait_us"] >= 0, row  # 0.5 s at 5 ms, two rounds
    # beside hogs of the same priority the probe queues for its cpu; Tidal's hogs at cpu.idle give way at once
    assert rows["tidal"]["wait_us"] < rows["none"]["wait_us"], rows
    assert _cgroups_named("tidal-bench-") == before


@pytest.mark.parametrize("args, says", [
    (["--treatments", "tidal_foreign"], "tidal_foreign, tidal_foreign_confined need --foreign-load"),
    (["--treatments", "static"], "no treatment 'static'"),
    (["--foreign-load", "system.service"], "'system.service': not a slice"),
    (["--foreign-load", "system.slice"], "systemd does not run this host"),
])
def test_refused_in_one_line_before_anything_runs(args, says):
    if says.startswith("systemd") and os.path.isdir("/run/systemd/system"):
        pytest.skip("a systemd host: the foreign load runs here (make test-systemd covers it)")
    before = _cgroups_named("tidal-bench-")
    proc = subprocess.run(TIDAL + ["bench", "cpu-isolation", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert _cgroups_named("tidal-bench-") == before

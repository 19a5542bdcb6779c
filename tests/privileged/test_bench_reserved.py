"""``tidal bench reserved`` end to end, short: every treatment measured, the reclaimed work ran where
each treatment put it, and nothing is left behind. (Its figures are the benchmark's business.)"""

import os

import pytest

from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]


def _cgroups_named(prefix: str):
    found = []
    for hierarchy, _, _ in os.walk("/sys/fs/cgroup"):
        if os.path.basename(hierarchy).startswith(prefix):
            found.append(hierarchy)
    return found


def test_one_short_round_of_each_treatment_and_nothing_left(tmp_path, monkeypatch):
    import tempfile

    from agent.bench.reserved import run

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the agent's state directory goes
    before = set(_cgroups_named("tidal-bench-"))
    report = run(duration=0.5, repeats=1)
    rows = report["treatments"]
    assert set(rows) == {"alone", "kept_off", "on_reserved"}
    assert rows["alone"]["reclaimed_cpu_s"] == 0
    for name in ("kept_off", "on_reserved"):
        assert rows[name]["reclaimed_cpu_s"] > 0.1, rows  # the kernel-heavy work ran
        assert rows[name]["samples"] > 50 and rows[name]["agent_p99_ms"] > 0
        assert rows[name]["daemon_p99_ratio"] == pytest.approx(rows[name]["daemon_p99_us"] /
                                                               rows["alone"]["daemon_p99_us"], rel=1e-2)
    assert set(_cgroups_named("tidal-bench-")) == before
    assert os.listdir(tmp_path) == []  # nor the agent's state directory

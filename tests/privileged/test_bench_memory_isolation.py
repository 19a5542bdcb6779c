"""``tidal bench memory-isolation`` end to end, short, on real cgroups (v1 on the host, v2 in the VM
tier): every treatment reports, Tidal puts a kernel limit on offline memory under what online leaves and
no online process is OOM-killed, nothing is left behind. (Latency and harvest are the benchmark's figures,
not a test's.)"""

import glob
import os
import subprocess

import pytest

from agent.bench import memory_isolation
from agent.errors import TidalError
from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]
MIB = 1 << 20


def disk_directory():
    for directory in ("/var/tmp", os.getcwd()):
        if not os.access(directory, os.W_OK) or os.statvfs(directory).f_flag & os.ST_RDONLY:
            continue
        try:
            memory_isolation.check_disk_backed(directory)
            return directory
        except TidalError:
            continue
    pytest.fail("no disk-backed directory (/var/tmp, the checkout): the VM tier mounts one over /var/tmp")


def test_tmpfs_is_refused_with_one_clear_line():
    if subprocess.run(["stat", "-f", "-c", "%T", "/dev/shm"], capture_output=True, text=True).stdout.strip() != "tmpfs":
        pytest.fail("/dev/shm is not tmpfs here")
    with pytest.raises(TidalError, match="page cache is never reclaimed"):
        memory_isolation.run(directory="/dev/shm", duration=1, repeats=1)


def test_one_short_round_of_an_outgrowing_job(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the agent's state directory goes
    directory = disk_directory()
    before = set(glob.glob(os.path.join(directory, "tidal-bench-mem-*")))
    # the job wants 1.2x what online leaves: the plain treatments meet the box's (or the job's) limit
    report = memory_isolation.run(box_mib=384, duration=2, repeats=1, offline_share=1.2, directory=directory)
    assert set(report["scenarios"]) == {"none", "limit", "tidal"}
    assert report["alone"]["samples"] >= 300 and report["alone"]["oom_kills"] == {"online": 0, "offline": 0}
    for name, row in report["scenarios"].items():
        assert row["samples"] >= 300, name  # the service answered through the run, killed by no one
        assert row["oom_kills"]["online"] == 0, name
        assert 0 < row["offline_mib"] and 0 < row["left_by_online_mib"] < 384, (name, {
            k: row.get(k) for k in ("offline_mib", "left_by_online_mib", "offline_refused", "limits", "seen",
                                    "evictions", "throttles")})
        # one round: its p99 is the pooled one, and the settled half of the harvest is measured too
        assert row["p99_us_by_round"] == [row["p99_us"]] and row["p99_round_median_ratio"] == row["p99_ratio"], name
        assert row["offline_mib_settled"] > 0, name
    assert report["alone"]["p99_spread"] is None  # one round: no spread to report
    tidal = report["scenarios"]["tidal"]
    # Tidal's kernel limit on offline memory: under the box less the service's working set (64 MiB anonymous,
    # 64 MiB of a mapped file, which sits on the inactive list and would read as free in MemAvailable's sense)
    (memory_max, _high), = tidal["limits"]
    assert 0 < memory_max <= (384 - 128) * MIB
    assert tidal["seen"][0]["node_bytes"] == 384 * MIB  # the box's limit read as the node's memory
    assert all(e["cause"] in ("memory", "pressure", "cpu") for e in tidal["evictions"])
    if report["cgroup_version"] == 2:
        # memory.low measured on the shared tree, and the online service's own cgroup (its pages are charged
        # there) taking its share of it
        assert [v for path, v in tidal["protection"][0].items() if path.endswith("/shared")][0] > 0
        assert tidal["online_memory_low"] == ["max"]
    assert set(glob.glob(os.path.join(directory, "tidal-bench-mem-*"))) == before
    assert os.listdir(tmp_path) == []  # nor the agent's state directory
    assert not glob.glob("/sys/fs/cgroup/**/tidal-bench-mem-*", recursive=True)

"""``tidal bench cpu-isolation --foreign-load cgroup``'s refusals, before anything is made: a systemd host
(its slices hold the load), and on cgroup v2 a harness in a cgroup that holds processes (its children could
not be given cpusets). The run itself: tests/privileged/test_bench_cpu_isolation.py."""

import os
from types import SimpleNamespace

import pytest

import agent.isolation.cgroups.driver as driver_module
from agent.bench import cpu_isolation
from agent.errors import TidalError


@pytest.fixture
def no_systemd(monkeypatch):
    real = os.path.isdir
    monkeypatch.setattr(cpu_isolation.os.path, "isdir",
                        lambda path: False if path == "/run/systemd/system" else real(path))


def test_a_systemd_host_is_told_to_name_a_slice(monkeypatch):
    real = os.path.isdir
    monkeypatch.setattr(cpu_isolation.os.path, "isdir",
                        lambda path: True if path == "/run/systemd/system" else real(path))
    with pytest.raises(TidalError, match=r"systemd runs this host.*--foreign-load system\.slice"):
        cpu_isolation.check_foreign_cgroup(SimpleNamespace(version=2))


def test_v2_from_a_cgroup_with_processes_is_refused(monkeypatch, no_systemd):
    monkeypatch.setattr(driver_module, "own_cgroups", lambda fs: {"": "/user.slice/session-1.scope"})
    with pytest.raises(TidalError, match=r"\(/user\.slice/session-1\.scope\) cannot hand cpusets.*root cgroup"):
        cpu_isolation.check_foreign_cgroup(SimpleNamespace(version=2))


@pytest.mark.parametrize("version, own", [(2, "/"), (1, "/some/where")])
def test_v2_from_the_root_and_v1_anywhere_may_run_it(monkeypatch, no_systemd, version, own):
    monkeypatch.setattr(driver_module, "own_cgroups", lambda fs: {"": own, "cpuset": own})
    cpu_isolation.check_foreign_cgroup(SimpleNamespace(version=version))

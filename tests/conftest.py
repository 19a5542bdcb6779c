"""Shared fixtures: hwloc snapshots (extracted once per session) and synthetic trees.

Fixtures are named by shape, as docs/architecture.md asks (``topo_dual_socket_ht``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from agent.topology import HostFS, discover
from agent.topology.synthetic import FakeNic, Shape, write_tree

HWLOC_DIR = Path(__file__).parent / "fixtures" / "hwloc"


def hwloc_cases():
    """``[(name, expected)]`` for every snapshot with an expected reading."""
    cases = []
    for path in sorted(HWLOC_DIR.glob("*.expected.json")):
        cases.append((path.name[: -len(".expected.json")], json.loads(path.read_text())))
    return cases


@pytest.fixture(scope="session")
def hwloc_trees(tmp_path_factory):
    """``{fixture name: extracted root}``: every snapshot, extracted once."""
    base = tmp_path_factory.mktemp("hwloc")
    roots = {}
    tar = shutil.which("tar")
    for name, expected in hwloc_cases():
        archive_path = HWLOC_DIR / f"{name}.tar.bz2"
        if tar:  # GNU tar is ~50x faster than tarfile on these many-small-file archives
            subprocess.run([tar, "-xjf", str(archive_path), "-C", str(base)], check=True)
        else:
            with tarfile.open(archive_path) as archive:
                archive.extractall(base)
        roots[name] = str(base / expected["root"])
    return roots


@pytest.fixture(scope="session")
def hwloc_topologies(hwloc_trees):
    return {name: discover(HostFS(root)) for name, root in hwloc_trees.items()}


def _synthetic(tmp_path_factory, name, shape):
    root = tmp_path_factory.mktemp(name)
    write_tree(str(root), shape)
    return discover(HostFS(str(root)))


@pytest.fixture(scope="session")
def topo_dual_socket_ht(tmp_path_factory):
    """2 sockets x 2 NUMA x 8 cores x 2 threads, 4 GPUs (one per NUMA), 2 NICs."""
    return _synthetic(tmp_path_factory, "dual_socket_ht", Shape(
        gpus=(0, 1, 2, 3), nics=(FakeNic("eth0", 0), FakeNic("eth1", 2))))


@pytest.fixture(scope="session")
def topo_single_socket_no_ht(tmp_path_factory):
    """1 socket, 1 NUMA node, 8 cores, 1 thread each."""
    return _synthetic(tmp_path_factory, "single_no_ht", Shape(sockets=1, numa_per_socket=1, threads_per_core=1))


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def terminate(proc, timeout: float = 60) -> None:
    """SIGTERM a test's process and reap it; SIGKILL it if it has not exited within ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpuset_dir(driver, path: str) -> str:
    """The directory holding a cgroup's cpuset files: v1's cpuset hierarchy, v2's one tree."""
    dirs = driver.where(path)
    return dirs.get("cpuset") or dirs["unified"]


privileged = pytest.mark.skipif(not is_root(), reason="needs root: writes real cgroups / network namespaces")


def pytest_sessionstart(session):
    """The cgroup v2 tier (``make test-cgroup2``) sets TIDAL_REQUIRE_CGROUP2: it must really run on v2."""
    if os.environ.get("TIDAL_REQUIRE_CGROUP2"):
        from agent.isolation.cgroups.detect import detect
        from agent.topology import HostFS

        mounts = detect(HostFS("/"))
        if mounts.version != 2:
            raise pytest.UsageError(f"TIDAL_REQUIRE_CGROUP2: this kernel offers cgroup v{mounts.version}")

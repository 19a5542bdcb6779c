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
# tests/systemd runs only inside make test-systemd's VM, under systemd as PID 1 on a node it installs Tidal on
# (scripts/systemd-vm.sh runs it there with --confcutdir, which leaves this file out)
collect_ignore = ["systemd"]


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
    from common.process import terminate as stop

    stop(proc, timeout)


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


# ---- an agent in this process ------------------------------------------------------------------------------
# What the tests that drive an agent in-process may change of AgentConfig, and why. Everything else is the
# shipped default; a test that needs more passes it, and says why at the call.
TEST_OVERRIDES = {
    # the API's long-polls and pollers check every 50 ms, not every second: the tests wait less
    "api_poll_interval": "answers within a test's patience",
    # a workload whose processes all ended is kept an hour, not released after the default grace: the
    # tests' workloads often have no process at all
    "empty_grace": "workloads with no process are kept",
    # the capacity counts all of the node's memory (the default sets 5%, at least 1 GiB, aside): the
    # figures a test expects are the node's own
    "memory_reserved_bytes": "capacity figures are the node's memory",
    # the reclaim pool keeps its maximum instead of following sampled usage (there is none in a test)
    "resize": "no usage-driven sizing",
    # which cpus are the reserved pool: the shape under test decides
    "reserved_cpus": "the reserved pool of the test's shape",
}


@pytest.fixture
def make_agent(tmp_path):
    """``make_agent(topology, driver=None, echo=None, name="a", state=None, start=True, **config)``: an
    ``Agent`` on a synthetic or captured topology, its socket (``<name>.sock``) and state directory
    (``state``, else ``<name>-state``: two agents given one ``state`` are a restart) under ``tmp_path``,
    cgroups recorded in memory
    (``driver``: a ``RecordingCgroups`` of the test's, else a new one). ``config`` may set only the
    fields of ``TEST_OVERRIDES`` (the reason for each is there) unless ``extra`` names the others a test
    needs. Every agent made is stopped at the end of the test."""
    from agent.daemon import Agent, AgentConfig
    from agent.isolation.cgroups.recording import RecordingCgroups

    made = []

    def make(topology, driver=None, echo=None, name="a", state=None, start=True, extra=(), **config):
        unknown = set(config) - set(TEST_OVERRIDES) - set(extra)
        assert not unknown, f"not a documented test override: {sorted(unknown)} (tests/conftest.py)"
        settings = {"socket_path": str(tmp_path / f"{name}.sock"),
                    "state_dir": str(tmp_path / (state or f"{name}-state")), **config}
        agent = Agent(AgentConfig(**settings), echo=echo or (lambda line: None),
                      driver=driver if driver is not None else RecordingCgroups(), topology=topology)
        made.append(agent)
        if start:
            agent.start()
        return agent

    yield make
    for agent in made:
        if agent.state is not None and not agent._stop.is_set():  # started, and not shut down by the test
            agent.shutdown()

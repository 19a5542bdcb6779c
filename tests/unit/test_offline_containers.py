"""A NodeManager's containers go to Tidal's reclaimed tree; the NodeManager stays where it is (#38).

The agent runs with a recording driver (nothing touches the host); the NodeManager's cgroup holds a fake
NodeManager and its containers, each with its /proc entry (environ, stat) in a fake /proc.
"""

from __future__ import annotations

import os
import signal

from agent.isolation.cgroups.recording import RecordingCgroups
from agent.services.offline_containers import OfflineContainers, container_of, workload_name
from agent.topology.synthetic import Shape, build_topology

TOPO = build_topology(Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, threads_per_core=1))
NM = "hadoop-yarn"


def fake_proc(root, pid, environ, started=100):
    os.makedirs(root / str(pid), exist_ok=True)
    (root / str(pid) / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")
    (root / str(pid) / "stat").write_text(f"{pid} (java) S 1 " + " ".join(["0"] * 17) + f" {started} 0 0\n")


def agent_with_nodemanager(make_agent, **config):
    """An agent told of a NodeManager in its own cgroup (--offline-cgroup, --yarn-nodemanager-cgroup)."""
    driver = RecordingCgroups()
    agent = make_agent(TOPO, driver=driver, reserved_cpus=(0,), resize=False, offline_cgroups=(NM,),
                       yarn_nodemanager_cgroups=(NM,), extra=("offline_cgroups", "yarn_nodemanager_cgroups", *config),
                       **config)
    driver.create(NM)
    return agent, driver


def test_containers_move_to_the_reclaimed_tree_and_the_nodemanager_stays(tmp_path, make_agent):
    agent, driver = agent_with_nodemanager(make_agent)
    proc = tmp_path / "proc"
    fake_proc(proc, 500, {"PATH": "/usr/bin", "HADOOP_HOME": "/opt"})  # the NodeManager
    fake_proc(proc, 600, {"CONTAINER_ID": "container_1_0001_01_000001", "PATH": "/usr/bin"})  # the AM
    fake_proc(proc, 601, {"CONTAINER_ID": "container_1_0001_01_000002"})
    for pid in (500, 600, 601):
        driver.move(NM, pid)
    agent.containers.proc = str(proc)
    killed = []
    agent.containers.kill = lambda pid, sig: killed.append(pid)
    try:
        assert agent.containers.adopt() == 2
        name = workload_name(NM)
        alloc = agent.state.get(name)
        assert alloc is not None and alloc.qos.value == "reclaimed_cores" and alloc.tier.value == "low"
        assert sorted(driver.procs(f"tidal/reclaimed/low/{name}")) == [600, 601]
        assert driver.procs(NM) == [500] and not killed
        assert agent.status()["offline_containers"]["cgroups"][NM]["daemon_pids"] == [500]
        # lent: the containers run on (the whole machine is offline's now)
        agent.lend("0s")
        agent.tick()
        assert agent.lending.current.state == "Offline" and agent.state.get(name) is not None
        # taken back: at the end of the notice reclaimed work is evicted: the containers stop, the
        # NodeManager lives on in its own cgroup
        agent.take_back("1h")
        agent.tick()
        assert agent.lending.current.state == "OfflineToOnline" and agent.state.get(name) is not None
        import time

        agent.tick(epoch=time.time() + 3601)
        assert agent.lending.current.state == "Online" and agent.state.get(name) is None
        assert [e["name"] for e in agent.eviction.evictions] == [name] and agent.eviction.evictions[0]["cause"] == "lending"
        assert sorted(agent.eviction.evictions[0]["pids"]) == [600, 601]
        assert driver.procs(NM) == [500]
    finally:
        agent.shutdown()


def test_the_containers_workload_stays_between_containers_and_takes_one_started_during_a_notice(tmp_path,
                                                                                                make_agent):
    """YARN is shown the floor from a notice's start and may start a container then: it joins the
    containers' workload, kept while empty, and stops with the rest at the notice's end (the YARN tier's
    day: an application submitted in the notice failed, its containers killed as new work in a transition)"""
    import time

    agent, driver = agent_with_nodemanager(make_agent)
    proc = tmp_path / "proc"
    fake_proc(proc, 800, {"CONTAINER_ID": "container_1_0003_01_000001"})
    agent.containers.proc = str(proc)
    killed = []
    agent.containers.kill = lambda pid, sig: killed.append(pid)
    name = workload_name(NM)
    try:
        driver.move(NM, 800)
        assert agent.containers.adopt() == 1
        driver.members[f"tidal/reclaimed/low/{name}"].remove(800)  # the container exited
        assert driver.procs(f"tidal/reclaimed/low/{name}") == []
        agent.tick()
        agent.tick()
        assert agent.state.get(name) is not None  # empty, and kept
        agent.lend("0s")
        agent.tick()
        agent.take_back("1h")
        agent.tick()
        assert agent.lending.current.state == "OfflineToOnline"
        fake_proc(proc, 801, {"CONTAINER_ID": "container_1_0004_01_000001"})
        driver.move(NM, 801)
        assert agent.containers.adopt() == 1 and not killed and agent.containers.refused == 0
        assert driver.procs(f"tidal/reclaimed/low/{name}") == [801]
        agent.tick(epoch=time.time() + 3601)
        assert agent.lending.current.state == "Online" and agent.state.get(name) is None
        assert agent.eviction.evictions[-1]["name"] == name and agent.eviction.evictions[-1]["pids"] == [801]
    finally:
        agent.shutdown()


def test_a_container_with_no_room_is_killed_once_and_counted(tmp_path, make_agent):
    agent, driver = agent_with_nodemanager(make_agent)
    proc = tmp_path / "proc"
    fake_proc(proc, 700, {"CONTAINER_ID": "container_1_0002_01_000001"})
    driver.move(NM, 700)
    agent.containers.proc = str(proc)
    killed = []
    agent.containers.kill = lambda pid, sig: killed.append((pid, sig))
    try:
        agent.admit({"name": "db", "qos": "dedicated_cores", "cpus": 3})  # every cpu but the reserved one
        assert agent.containers.adopt() == 0
        assert killed == [(700, signal.SIGKILL)] and agent.containers.refused == 1
        assert "no cpu is left for reclaimed work" in agent.containers.last_refusal
        assert agent.state.get(workload_name(NM)) is None
    finally:
        agent.shutdown()


def test_a_reused_pid_is_looked_at_again(tmp_path):
    proc = tmp_path / "proc"
    fake_proc(proc, 800, {"PATH": "/bin"}, started=10)
    moved = []
    service = OfflineContainers((NM,), lambda path: [800], admit=lambda doc: None,
                                attach=lambda name, pid: moved.append(pid), exists=lambda name: True, proc=str(proc))
    assert service.adopt() == 0
    fake_proc(proc, 800, {"CONTAINER_ID": "container_9"}, started=20)  # the pid reused by a container
    assert service.adopt() == 1 and moved == [800]
    assert container_of(999999, str(proc)) is None


def test_a_container_the_kernel_will_not_move_is_counted_once_and_shown(tmp_path, make_agent):
    """An attach the kernel refuses (EPERM: the DaemonSet's agent without SYS_NICE could not move root's
    container processes into a cpuset) is not "ended meanwhile": counted once per process, shown in status,
    metrics and `tidal status`, and tried again each pass; gone from the figure once moved or ended."""
    from agent.cli.render import status_lines
    from agent.errors import AdmissionError
    from agent.reporter.metrics import render

    agent, _ = agent_with_nodemanager(make_agent)
    proc = tmp_path / "proc"
    fake_proc(proc, 500, {"PATH": "/usr/bin"})  # the NodeManager
    fake_proc(proc, 600, {"CONTAINER_ID": "container_1_0001_01_000001"})
    fake_proc(proc, 601, {"CONTAINER_ID": "container_1_0001_01_000002"})  # ends before its move
    agent.containers.proc = str(proc)
    agent.containers.procs = lambda path: [500, 600, 601]
    tries = []

    def refuse(name, pid):
        tries.append(pid)
        if pid == 601:
            (proc / "601" / "environ").unlink()
            (proc / "601" / "stat").unlink()
            os.rmdir(proc / "601")
        raise AdmissionError(f"cannot attach pid {pid}: [Errno 1] Operation not permitted")

    agent.containers.attach = refuse
    try:
        assert agent.containers.adopt() == 0 and agent.containers.adopt() == 0
        assert tries == [600, 601, 600]  # tried again each pass; 601 gone after the first
        status = agent.status()["offline_containers"]
        assert status["attach_failures"] == 1 and status["unmoved"] == 1 and status["adopted"] == 0, status
        assert "Operation not permitted" in status["last_attach_error"]
        assert any("1 NOT MOVED" in line and "Operation not permitted" in line for line in status_lines(agent.status()))
        text = render(agent).decode()
        assert 'tidal_offline_container_processes_total{outcome="not_moved"} 1.0' in text
        assert "tidal_offline_container_processes_unmoved 1.0" in text
        agent.containers.attach = lambda name, pid: None  # the kernel moves it now
        assert agent.containers.adopt() == 1
        status = agent.status()["offline_containers"]
        assert status["unmoved"] == 0 and status["attach_failures"] == 1 and status["adopted"] == 1
        assert not any("NOT MOVED" in line for line in status_lines(agent.status()))
    finally:
        agent.shutdown()

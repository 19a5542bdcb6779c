"""The online side of a tidal day on a real node (pytest -m node): requests to an online pod measured
through a day's curve of load, with a reclaimed batch pod beside it and without, on the kubelet,
containerd and Tidal's DaemonSet of the node tier (its chart as installed there).

The scheduler tier's day (tests/k8s/test_day.py) runs the cluster's side on KWOK nodes, whose pods
serve nothing; this is the node's side, where requests are served: one online pod (shared_cores, the
default) runs busybox's httpd with a CGI handler that burns a few milliseconds of cpu, and the test
process sends it requests on a schedule whose rate follows ``cluster.simulate.diurnal`` (the day's
curve: evening peak, night valley at 30% of it), one step per three day-hours. At the peak the
requests take ``PEAK_LOAD`` of the pod cpu (the HorizontalPodAutoscaler's target of the day: the
replicas the HPA keeps run at that share of their cpu). Offline work runs the whole day: a reclaimed
batch pod (tier low) spinning, and YARN's application (below). Each step is measured three times, back
to back: online alone (the offline work stopped: SIGSTOP, the same minute's machine), beside the batch
pod (YARN stopped) and beside YARN (the batch pod stopped): the two offline classes are measured apart,
since they do not share a cpu fairly (a reclaimed pod comes first: docs/agent.md). A step breaks the SLO
*because of offline work* when its p99 is over the SLO beside either and within it alone.

Latency counts from when a request was due, not when it was sent (a late request's wait is part of
its latency). The test process runs on the reserved cpu (the harness pins it there), the pods on the
free cpu of this 2-cpu host.

YARN lives on the same node all day, wired as docs/offline-agents.md tells users but through the chart:
the agent's config file (the chart's ``agent.config``) names the ResourceManager and the NodeManager's
cgroup, and the daemons start on the host under ``tidal run --offline-cgroup`` against the DaemonSet
agent's socket. One application (distributed shell, ``YARN_CONTAINERS`` containers spinning in user mode)
runs through the whole day, started and running before the first step; "stopped" is SIGSTOP on every
process YARN launched (what carries its ``CONTAINER_ID``). Applications started one after another through
the day were tried too: each one's master is a JVM whose start ran on the online pod's one cpu
(docs/benchmarks has what that cost).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Set

import psutil

import numpy as np
import pytest

from agent.client import AgentClient
from cluster.simulate import SimConfig, diurnal
from tests.conftest import privileged
from tests.k8s.controlplane import free_port, wait_for
from tests.node.test_node import (AGENT_SOCKET, delete_pod, install_tidal, pod, pod_cpuset_dir, real_node, run_pod,
                                  running_pids)
from tests.offline_cgroup import OfflineCgroup
from tests.yarn.hadoop import Yarn, site_properties
from tests.yarn.hadoop import testbin as yarn_testbin
from tests.yarn.test_yarn_real import reclaimed_cpu_seconds as reclaimed_tree_cpu_seconds

pytestmark = [pytest.mark.node, privileged]

# the trace's SLO: the online service's p99 latency, and the share of its pod cpu at the evening peak
SLO_P99_MS = 50.0
PEAK_LOAD = 0.6
STEPS = 8  # one per three day-hours
STEP_S = 8.0  # each half of a step (alone, then beside the batch pod), seconds
SERVICE_MS = 4.0  # the cpu a request's handler burns, roughly (calibrated below: the rate follows what it took)
# the day's YARN application: its container spins (user mode) all day. One: Hadoop 3.4.3's distributed shell
# renames its script in place on a local file system (fs.defaultFS file:///) as it launches each container,
# and a second launch does not find it (FileNotFoundException in the master's log: the container never starts)
YARN_CONTAINERS = 1


def cgi_command(port: int, loops: int) -> str:
    """The online pod's command: busybox httpd in the foreground on the host's loopback, one CGI handler
    that counts to ``loops`` (cpu, no sleep) and answers."""
    script = ("#!/bin/sh\\nprintf \"Content-Type: text/plain\\\\r\\\\n\\\\r\\\\n\"\\ni=0\\n"
              f"while [ $i -lt {loops} ]; do i=$((i+1)); done\\necho ok\\n")
    return (f"mkdir -p /srv/cgi-bin && printf '{script}' > /srv/cgi-bin/w && chmod +x /srv/cgi-bin/w && "
            f"exec httpd -f -p 127.0.0.1:{port} -h /srv")


def request(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /cgi-bin/w HTTP/1.0\r\n\r\n")
        answer = b""
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    if not answer.startswith(b"HTTP/1.") or b" 200 " not in answer.split(b"\r\n", 1)[0] or not answer.endswith(b"ok\n"):
        raise AssertionError(f"the online pod answered {answer[:200]!r}")


def drive(port: int, rate: float, seconds: float) -> List[float]:
    """Requests due every 1/rate seconds for ``seconds``; each one's latency (ms) from when it was due."""
    latencies: List[float] = []
    start = time.monotonic()
    for k in range(int(seconds * rate)):
        due = start + k / rate
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        request(port)
        latencies.append((time.monotonic() - due) * 1000.0)
    return latencies


def p99(values: List[float]) -> float:
    return float(np.percentile(values, 99))


def cpu_seconds(pod_doc: Dict) -> float:
    """The pod's cgroup's cpu time, as the kernel counts it (v1 cpuacct, v2 cpu.stat)."""
    directory = pod_cpuset_dir(pod_doc)
    assert directory, f"no cgroup for pod {pod_doc['metadata']['name']}"
    v1 = directory.replace("/cpuset/", "/cpuacct/") + "/cpuacct.usage"
    if "/cpuset/" in directory and os.path.exists(v1):
        with open(v1) as handle:
            return int(handle.read()) / 1e9
    with open(f"{directory}/cpu.stat") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("usage_usec")) / 1e6


def signal_all(pids: Dict[str, int], sig: int) -> None:
    for pid in pids.values():
        os.kill(pid, sig)


class YarnOnTheNode:
    """A ResourceManager and a NodeManager on this host, wired to the DaemonSet's agent: ``agent_config`` is
    what the chart's ``agent.config`` adds for them (docs/offline-agents.md's flags, as config keys); the
    daemons start once the agent serves, under ``tidal run --offline-cgroup`` (its default socket, the
    chart's)."""

    def __init__(self, work: Path) -> None:
        lib = yarn_testbin()
        if lib is None:
            pytest.skip("no Hadoop jars: run `make yarn-testbin`")
        fragment = subprocess.run([sys.executable, "-m", "agent.cli", "yarn", "config"], capture_output=True,
                                  text=True, check=True).stdout
        self.work = work
        self.yarn = Yarn(lib, work, node_manager=site_properties(fragment))
        uid = uuid.uuid4().hex[:8]
        # the daemons' own cgroups (the agent makes what else it needs of them; removed after)
        self.nm_cgroup = OfflineCgroup(f"tidal-day-nm-{uid}")
        self.rm_cgroup = OfflineCgroup(f"tidal-day-rm-{uid}")
        self.agent_config = {"yarn-rm": self.yarn.web, "yarn-node-host": "localhost",  # the NM listens on loopback
                             "yarn-nodemanager-cgroup": ["/" + self.nm_cgroup.name],
                             "offline-cgroup": ["/" + self.rm_cgroup.name]}
        self.nm: Optional[subprocess.Popen] = None

    def offline_run(self, cgroup: OfflineCgroup, argv: List[str]) -> List[str]:
        return [sys.executable, "-m", "agent.cli", "run", "--offline-cgroup", "/" + cgroup.name, "--", *argv]

    def start(self) -> None:
        self.yarn.start("rm", self.offline_run(self.rm_cgroup, self.yarn.java(
            "org.apache.hadoop.yarn.server.resourcemanager.ResourceManager")))
        self.yarn.wait_rm()
        self.nm = self.yarn.start("nm", self.offline_run(self.nm_cgroup, self.yarn.nm_argv()))
        wait_for(lambda: self.node() is not None, "the NodeManager to register", timeout=180, interval=1)

    def node(self) -> Optional[Dict]:
        live = [n for n in self.yarn.nodes() if n.get("state") == "RUNNING"]
        return live[0] if len(live) == 1 else None

    def containers(self) -> Set[int]:
        """Every process YARN launched for an application (its CONTAINER_ID in the environment): the
        NodeManager's descendants, never the NodeManager."""
        found: Set[int] = set()
        try:
            children = psutil.Process(self.nm.pid).children(recursive=True)
        except psutil.Error:
            return found
        for child in children:
            try:
                if "CONTAINER_ID" in child.environ():
                    found.add(child.pid)
            except psutil.Error:
                pass
        return found

    def stop(self) -> None:
        self.yarn.stop_all()
        self.nm_cgroup.remove()
        self.rm_cgroup.remove()


class Application(threading.Thread):
    """One distributed-shell application through the day: ``YARN_CONTAINERS`` containers, each spinning in
    user mode (bash counting) until the day is over (``finish()`` makes the file they look for, between
    counts), then the application ends and says whether it succeeded."""

    def __init__(self, on: YarnOnTheNode) -> None:
        super().__init__(daemon=True)
        self.on = on
        self.over = on.work / "day-over"
        self.script = on.work / "spin.sh"
        self.script.write_text(f"while [ ! -e {self.over} ]; do i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; "
                               "done\n")
        self.result: Optional[Dict] = None

    def run(self) -> None:
        log = self.on.work / "app.log"
        started = time.monotonic()
        with open(log, "wb") as out:
            # the client, like the RM, in the offline cgroup of YARN's daemons on this host
            rc = subprocess.run(self.on.offline_run(self.on.rm_cgroup, self.on.yarn.distributed_shell(
                self.script, seconds=1200, containers=YARN_CONTAINERS)), stdout=out, stderr=subprocess.STDOUT,
                env=self.on.yarn.env()).returncode
        text = log.read_text(errors="replace")
        ok = rc == 0 and "Application completed successfully" in text
        self.result = {"succeeded": ok, "seconds": round(time.monotonic() - started, 1),
                       **({} if ok else {"log": text[-2000:]})}

    def running(self) -> bool:
        """Its master and every container launched and running (the NodeManager's word: the RM counts a
        container running from its allocation, before the master has asked the NodeManager to start it)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.on.yarn.ports['nmweb']}/ws/v1/node/containers",
                                        timeout=10) as response:
                listed = (json.loads(response.read()).get("containers") or {}).get("container") or []
        except (OSError, ValueError):
            return False
        return sum(c.get("state") == "RUNNING" for c in listed) >= YARN_CONTAINERS + 1

    def finish(self, timeout: float) -> None:
        self.over.touch()
        self.join(timeout)
        assert not self.is_alive(), f"the day's YARN application still ran {timeout} s after the day"


class Stopped:
    """Offline work stopped (SIGSTOP) for a while: ``pids`` (the batch pod's processes), and, with ``on``,
    YARN's containers, those it launches meanwhile included (looked for every 0.1 s)."""

    def __init__(self, pids: Dict[str, int], on: Optional[YarnOnTheNode]) -> None:
        self.pids, self.on = pids, on
        self.stopped: Set[int] = set()
        self.done = threading.Event()
        self.watch = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while self.on is not None and not self.done.is_set():
            for pid in self.on.containers() - self.stopped:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped.add(pid)
                except ProcessLookupError:
                    pass
            self.done.wait(0.1)

    def __enter__(self) -> "Stopped":
        signal_all(self.pids, signal.SIGSTOP)
        self.stopped = set()
        self.done.clear()
        self.watch = threading.Thread(target=self._watch, daemon=True)
        self.watch.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.watch.join()
        signal_all(self.pids, signal.SIGCONT)
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_online_requests_hold_their_slo_through_the_day_beside_reclaimed_work(tmp_path):
    on = YarnOnTheNode(tmp_path)
    with real_node() as node:
        try:
            install_tidal(node, agent_config=on.agent_config)
            on.start()
            nm_pid = on.nm.pid
            report = _day(node, on)
            yarn_end = {"nm_same_process": on.nm.poll() is None and on.nm.pid == nm_pid,
                        "rm_view": _rm_view(on), "tidal_view": _tidal_view(), "tree_weight": _tree_weight()}
        finally:
            print("NodeManager:", on.yarn.tail("nm", 30))
            print("containers' ends:", [line for line in on.yarn.tail("nm", 100000).splitlines()
                                        if "exit code" in line or "EXITED" in line])
            on.stop()
    report["yarn"].update(yarn_end)
    print("day on the real node:", json.dumps(report, indent=1))
    steps = report["steps"]
    assert all(s["samples"] >= 2 * STEP_S for s in steps), steps
    # the figure: no minute of the day over the SLO because of offline work
    caused = report["slo_steps_over"]["caused_by_offline"]
    assert not caused, f"p99 over {SLO_P99_MS} ms beside offline work and not alone at hours {caused}"
    # nor, within the SLO, slower by much. On this cgroup v1 host the batch pod runs at cpu.shares 2 on the
    # online pod's cpu (no cpu.idle on v1): a request that wakes while it runs may wait out a scheduler slice
    # (a few ms), so the cost moves with the run's conditions. Medians in the four runs with figures: 0.97,
    # 0.99, 1.006 and 1.324 (CI, 2026-11-29: up to +3.6 ms at p99, every step within the 50 ms SLO); a step
    # 0.63-1.42. The bound is what fails if the batch competed at online's weight: each request would share
    # its cpu half and half with the spinning batch, its service time doubled (2x or more at p99). YARN's
    # containers at the default weight of Tidal's top cgroup measured 1.31-1.55 (three runs, 2026-11-29)
    assert report["median_p99_ratio"]["batch"] <= 1.6, [s["p99_ratio"] for s in steps]
    assert report["median_p99_ratio"]["yarn"] <= 1.6, [s["p99_ratio"] for s in steps]
    # each part ran what it says (what was stopped used no cpu), and offline work ran through the day: it
    # took what online left of the free cpu, and the node did more
    assert max(s["stopped_cpus"] for s in steps) < 0.02, steps
    assert min(s["batch_cpus"] for s in steps) > 0.2, steps
    busy = report["pods_cpu_busy"]
    assert busy["beside_batch"] > busy["separate_pools"] + 0.2, busy
    assert busy["beside_yarn"] > busy["separate_pools"] + 0.2, busy
    # YARN on the same node all day, through the DaemonSet's agent: its application succeeded, its containers
    # ran in Tidal's reclaimed tree every step (on what online left), every container process moved there
    # (none left unbounded where the kernel refused the move, as it did before the DaemonSet held SYS_NICE)
    # and none killed (no notice ended any of it), the NodeManager stayed, and the RM holds Tidal's figure
    yarn = report["yarn"]
    assert yarn["application"]["succeeded"], yarn["application"]
    assert min(s["yarn_cpus"] for s in steps) > 0.2, steps
    containers = yarn["offline_containers"]
    assert containers["adopted"] >= YARN_CONTAINERS + 1 and containers["attach_failures"] == 0, containers
    assert containers["refused"] == 0, containers
    assert yarn["nm_same_process"], yarn
    assert yarn["rm_view"] == yarn["tidal_view"], yarn
    # YARN's containers run in Tidal's tree, beside the kubelet's kubepods at the hierarchy's top: the tree
    # weighs the least there (cpu.idle is relative to siblings; desired.base_weight)
    assert yarn["tree_weight"] in ({"cpu.shares": "2"}, {"cpu.weight": "1"}), yarn


def _day(node, on: YarnOnTheNode) -> Dict:
    port = free_port()
    online, batch = f"online-{uuid.uuid4().hex[:4]}", f"batch-{uuid.uuid4().hex[:4]}"
    # the handler's loop count for about SERVICE_MS of cpu: busybox sh counts ~1-3 M a second
    loops = int(os.environ.get("TIDAL_DAY_NODE_LOOPS", "4000"))
    run_pod(node, online, "500m", limits=False, command=cgi_command(port, loops))
    running_pids(node, online)
    wait_for(lambda: _answers(port), "the online pod's httpd answering", timeout=30, interval=0.2)
    # what a request takes alone, unloaded: the rate of each step is a share of the cpu it needs
    service_ms = float(np.median(drive(port, 20.0, 2.0)))
    peak_rate = PEAK_LOAD * 1000.0 / service_ms
    wait_for(lambda: AgentClient(AGENT_SOCKET).request("GET", "/v1/capacity")["reclaimed"]["millicpu"] >= 200,
             "reclaimed capacity of at least 200 millicpu", timeout=180, interval=1)
    # the day's YARN application, running before the batch pod starts: reclaimed work in Tidal's tree yields
    # to every pod, the batch pod's spin included (desired.base_weight), and its master would wait for it
    app = Application(on)
    yarn_before = reclaimed_cpu_seconds()
    app.start()
    wait_for(app.running, "the day's YARN application running, its master and containers", timeout=240, interval=1)
    run_pod(node, batch, "100m", limits=False, command="while true; do :; done",
            annotations={"tidal.io/qos-level": "reclaimed_cores", "tidal.io/tier": "low"})
    batch_pids = running_pids(node, batch)
    # a new reclaimed workload spends its first periods off online's idle cpus (services.kernel_work), and one
    # that ran in the kernel (YARN's: its master is a JVM that starts there) waits off them up to 60 periods
    # where nothing is lent (CI, 2026-11-29: YARN at 10 millicpu through the day's first two steps)
    wait_for(lambda: _settled(f"default/{batch}"), "the batch pod off probation", timeout=60)
    yarn_workload = AgentClient(AGENT_SOCKET).request("GET", "/v1/status")["offline_containers"]["cgroups"][
        on.nm_cgroup.name]["workload"]
    wait_for(lambda: _settled(name=yarn_workload), "YARN's containers free to take online's idle cpu", timeout=150)
    batch_doc, online_doc = pod(node, batch), pod(node, online)
    config = SimConfig()
    hours = [3.0 * i + 1.5 for i in range(STEPS)]
    shares = diurnal(config, np.array([h * 60.0 for h in hours]))
    steps = []
    for hour, share in zip(hours, shares):
        rate = max(2.0, peak_rate * float(share))
        parts = {}
        # online alone; beside the batch pod (YARN's containers stopped); beside YARN (the batch pod stopped)
        for part, stop_batch, stop_yarn in (("alone", True, True), ("batch", False, True), ("yarn", True, False)):
            with Stopped(batch_pids if stop_batch else {}, on if stop_yarn else None):
                before = cpu_seconds(online_doc), cpu_seconds(batch_doc), reclaimed_cpu_seconds(), time.monotonic()
                latencies = drive(port, rate, STEP_S)
                elapsed = time.monotonic() - before[3]
                parts[part] = {"p99": p99(latencies), "samples": len(latencies),
                               "over_20ms": sum(v > 20 for v in latencies),
                               "online": (cpu_seconds(online_doc) - before[0]) / elapsed,
                               "batch": (cpu_seconds(batch_doc) - before[1]) / elapsed,
                               "yarn": (reclaimed_cpu_seconds() - before[2]) / elapsed}
        alone = parts["alone"]
        steps.append({"hour": hour, "load": round(PEAK_LOAD * float(share), 3), "rate": round(rate, 1),
                      "p99_ms": {k: round(v["p99"], 2) for k, v in parts.items()},
                      "p99_ratio": {k: round(parts[k]["p99"] / alone["p99"], 3) for k in ("batch", "yarn")},
                      "online_cpus": {k: round(v["online"], 3) for k, v in parts.items()},
                      "batch_cpus": round(parts["batch"]["batch"], 3), "yarn_cpus": round(parts["yarn"]["yarn"], 3),
                      # what was stopped ran nothing: the halves are what they say
                      "stopped_cpus": round(max(alone["batch"], alone["yarn"], parts["batch"]["yarn"],
                                                parts["yarn"]["batch"]), 3),
                      "samples": min(v["samples"] for v in parts.values()),
                      "over_20ms": {k: v["over_20ms"] for k, v in parts.items()}})
    # the day is over for YARN too: its containers stop counting and the application ends (the batch pod
    # gone first: YARN's master yields to it)
    delete_pod(node, batch)
    app.finish(timeout=180)
    yarn_cpu = reclaimed_cpu_seconds() - yarn_before
    # the same batch work with no Tidal QoS (a plain pod: what the kubelet alone makes of it), at the valley
    # and the peak, for the report: what the reclaimed pod's treatment is worth. YARN submits nothing more:
    # to Tidal the plain pod is online (shared_cores), it leaves no capacity, and a container placed anyway
    # would be killed on arrival (offline_containers.refused)
    plain = f"plain-{uuid.uuid4().hex[:4]}"
    run_pod(node, plain, "100m", limits=False, command="while true; do :; done")
    plain_pids = running_pids(node, plain)
    plain_doc = pod(node, plain)
    naive = []
    for hour, share in ((4.5, min(shares)), (19.5, max(shares))):
        rate = max(2.0, peak_rate * float(share))
        signal_all(plain_pids, signal.SIGSTOP)
        try:
            alone = drive(port, rate, STEP_S)
        finally:
            signal_all(plain_pids, signal.SIGCONT)
        used, started = cpu_seconds(plain_doc), time.monotonic()
        beside = drive(port, rate, STEP_S)
        naive.append({"hour": hour, "alone_p99_ms": round(p99(alone), 2), "plain_p99_ms": round(p99(beside), 2),
                      "p99_ratio": round(p99(beside) / p99(alone), 3),
                      "batch_cpus": round((cpu_seconds(plain_doc) - used) / (time.monotonic() - started), 3)})
    delete_pod(node, plain)
    delete_pod(node, online)
    over = {part: [s["hour"] for s in steps if s["p99_ms"][part] > SLO_P99_MS] for part in ("alone", "batch", "yarn")}
    caused = sorted({h for part in ("batch", "yarn") for h in over[part] if h not in over["alone"]})
    return {"slo_p99_ms": SLO_P99_MS, "service_ms": round(service_ms, 2), "peak_load": PEAK_LOAD,
            "steps": steps, "slo_steps_over": {**{k: len(v) for k, v in over.items()}, "caused_by_offline": caused},
            "median_p99_ratio": {k: round(float(np.median([s["p99_ratio"][k] for s in steps])), 3)
                                 for k in ("batch", "yarn")},
            # the pods' cpu busy: online alone is what separate pools would use of it; Tidal adds offline work
            "pods_cpu_busy": {"separate_pools": round(float(np.mean([s["online_cpus"]["alone"] for s in steps])), 3),
                              "beside_batch": round(float(np.mean([s["online_cpus"]["batch"] + s["batch_cpus"]
                                                                   for s in steps])), 3),
                              "beside_yarn": round(float(np.mean([s["online_cpus"]["yarn"] + s["yarn_cpus"]
                                                                  for s in steps])), 3)},
            "plain_pod": naive,
            "offline_cpu_seconds": {"batch": round(sum(s["batch_cpus"] for s in steps) * STEP_S, 1),
                                    "yarn": round(sum(s["yarn_cpus"] for s in steps) * STEP_S, 1)},
            "yarn": {"application": app.result, "reclaimed_tree_cpu_s": round(yarn_cpu, 1),
                     "offline_containers": AgentClient(AGENT_SOCKET).request("GET", "/v1/status")["offline_containers"]}}


def _tree_weight() -> Dict[str, str]:
    """The weight of Tidal's top cgroup (the chart's base, "tidal") as the kernel has it."""
    from agent.isolation.cgroups.detect import detect
    from agent.topology import HostFS

    mounts = detect(HostFS("/"))
    name, root = ("cpu.shares", mounts.mounts["cpu"]) if mounts.version == 1 else ("cpu.weight", mounts.mounts[""])
    with open(f"{root}/tidal/{name}") as handle:
        return {name: handle.read().strip()}


def _rm_view(on: YarnOnTheNode):
    node = on.node()
    return None if node is None else [node["totalResource"]["vCores"], node["totalResource"]["memory"]]


def _tidal_view():
    body = AgentClient(AGENT_SOCKET).request("GET", "/v1/capacity?format=yarn")["resource"]
    return [body["vCores"], body["memory"]]


def reclaimed_cpu_seconds() -> float:
    """Cpu time used so far in Tidal's reclaimed tree (the chart's cgroup base): YARN's containers, which the
    agent moves there; the batch pod stays in the kubelet's cgroup."""
    return reclaimed_tree_cpu_seconds("tidal")


def _answers(port: int) -> bool:
    try:
        request(port)
        return True
    except (OSError, AssertionError):
        return False


def _settled(label: Optional[str] = None, name: Optional[str] = None) -> bool:
    """the reclaimed workload (by its label, or its name) off probation and not kept off online's idle cpus"""
    client = AgentClient(AGENT_SOCKET)
    status = client.request("GET", "/v1/status")
    mine = [w["name"] for w in client.request("GET", "/v1/workloads")["workloads"]
            if (label is not None and w.get("label") == label) or (name is not None and w["name"] == name)]
    kept = set(status["kernel_work"]["probation"]) | set(status["kernel_work"]["confined"])
    return bool(mine) and mine[0] not in kept

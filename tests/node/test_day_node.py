"""The online side of a tidal day on a real node (pytest -m node): requests to an online pod measured
through a day's curve of load, with a reclaimed batch pod beside it and without, on the kubelet,
containerd and Tidal's DaemonSet of the node tier (its chart as installed there).

The scheduler tier's day (tests/k8s/test_day.py) runs the cluster's side on KWOK nodes, whose pods
serve nothing; this is the node's side, where requests are served: one online pod (shared_cores, the
default) runs busybox's httpd with a CGI handler that burns a few milliseconds of cpu, and the test
process sends it requests on a schedule whose rate follows ``cluster.simulate.diurnal`` (the day's
curve: evening peak, night valley at 30% of it), one step per three day-hours. At the peak the
requests take ``PEAK_LOAD`` of the pod cpu (the HorizontalPodAutoscaler's target of the day: the
replicas the HPA keeps run at that share of their cpu). A reclaimed batch pod (tier low) spins the
whole day. Each step is measured twice, back to back: the batch pod stopped (SIGSTOP: the online pod
alone, the same minute's machine) and running; a step breaks the SLO *because of offline work* when
its p99 is over the SLO with the batch pod running and within it alone.

Latency counts from when a request was due, not when it was sent (a late request's wait is part of
its latency). The test process runs on the reserved cpu (the harness pins it there), the pods on the
free cpu of this 2-cpu host.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from typing import Dict, List

import numpy as np
import pytest

from agent.client import AgentClient
from cluster.simulate import SimConfig, diurnal
from tests.conftest import privileged
from tests.k8s.controlplane import free_port, wait_for
from tests.node.test_node import (AGENT_SOCKET, delete_pod, install_tidal, pod, pod_cpuset_dir, real_node, run_pod,
                                  running_pids)

pytestmark = [pytest.mark.node, privileged]

# the trace's SLO: the online service's p99 latency, and the share of its pod cpu at the evening peak
SLO_P99_MS = 50.0
PEAK_LOAD = 0.6
STEPS = 8  # one per three day-hours
STEP_S = 8.0  # each half of a step (alone, then beside the batch pod), seconds
SERVICE_MS = 4.0  # the cpu a request's handler burns, roughly (calibrated below: the rate follows what it took)


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


def test_online_requests_hold_their_slo_through_the_day_beside_reclaimed_work():
    with real_node() as node:
        install_tidal(node)
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
        run_pod(node, batch, "100m", limits=False, command="while true; do :; done",
                annotations={"tidal.io/qos-level": "reclaimed_cores", "tidal.io/tier": "low"})
        batch_pids = running_pids(node, batch)
        # a new reclaimed workload spends its first periods off online's idle cpus (services.kernel_work)
        wait_for(lambda: _settled(f"default/{batch}"), "the batch pod off probation", timeout=60)
        batch_doc, online_doc = pod(node, batch), pod(node, online)
        config = SimConfig()
        hours = [3.0 * i + 1.5 for i in range(STEPS)]
        shares = diurnal(config, np.array([h * 60.0 for h in hours]))
        steps = []
        try:
            for hour, share in zip(hours, shares):
                rate = max(2.0, peak_rate * float(share))
                signal_all(batch_pids, signal.SIGSTOP)
                before = cpu_seconds(online_doc), time.monotonic()
                alone = drive(port, rate, STEP_S)
                online_alone = (cpu_seconds(online_doc) - before[0]) / (time.monotonic() - before[1])
                signal_all(batch_pids, signal.SIGCONT)
                before = cpu_seconds(online_doc), cpu_seconds(batch_doc), time.monotonic()
                beside = drive(port, rate, STEP_S)
                elapsed = time.monotonic() - before[2]
                online_beside = (cpu_seconds(online_doc) - before[0]) / elapsed
                offline_cpus = (cpu_seconds(batch_doc) - before[1]) / elapsed
                steps.append({"hour": hour, "load": round(PEAK_LOAD * float(share), 3), "rate": round(rate, 1),
                              "alone_p99_ms": round(p99(alone), 2), "tidal_p99_ms": round(p99(beside), 2),
                              "p99_ratio": round(p99(beside) / p99(alone), 3),
                              "online_cpus": [round(online_alone, 3), round(online_beside, 3)],
                              "offline_cpus": round(offline_cpus, 3), "samples": len(beside)})
        finally:
            signal_all(batch_pids, signal.SIGCONT)
        delete_pod(node, batch)
        # the same batch work with no Tidal QoS (a plain pod: what the kubelet alone makes of it), at the
        # valley and the peak, for the report: what the reclaimed pod's treatment is worth
        plain = f"plain-{uuid.uuid4().hex[:4]}"
        run_pod(node, plain, "100m", limits=False, command="while true; do :; done")
        plain_pids = running_pids(node, plain)
        plain_doc = pod(node, plain)
        naive = []
        try:
            for hour, share in ((4.5, min(shares)), (19.5, max(shares))):
                rate = max(2.0, peak_rate * float(share))
                signal_all(plain_pids, signal.SIGSTOP)
                alone = drive(port, rate, STEP_S)
                signal_all(plain_pids, signal.SIGCONT)
                used, started = cpu_seconds(plain_doc), time.monotonic()
                beside = drive(port, rate, STEP_S)
                naive.append({"hour": hour, "alone_p99_ms": round(p99(alone), 2), "plain_p99_ms": round(p99(beside), 2),
                              "p99_ratio": round(p99(beside) / p99(alone), 3),
                              "batch_cpus": round((cpu_seconds(plain_doc) - used) / (time.monotonic() - started), 3)})
        finally:
            signal_all(plain_pids, signal.SIGCONT)
        delete_pod(node, plain)
        delete_pod(node, online)
    over_beside = [s["hour"] for s in steps if s["tidal_p99_ms"] > SLO_P99_MS]
    over_alone = [s["hour"] for s in steps if s["alone_p99_ms"] > SLO_P99_MS]
    caused = [h for h in over_beside if h not in over_alone]
    ratios = [s["p99_ratio"] for s in steps]
    report = {"slo_p99_ms": SLO_P99_MS, "service_ms": round(service_ms, 2), "peak_load": PEAK_LOAD,
              "steps": steps, "slo_steps_over": {"beside_offline": len(over_beside), "alone": len(over_alone),
                                                 "caused_by_offline": len(caused)},
              "median_p99_ratio": round(float(np.median(ratios)), 3),
              # the pods' cpu busy: online alone is what separate pools would use of it, Tidal adds the batch pod
              "pods_cpu_busy": {"separate_pools": round(float(np.mean([s["online_cpus"][0] for s in steps])), 3),
                                "tidal": round(float(np.mean([sum(s["online_cpus"][1:]) + s["offline_cpus"]
                                                              for s in steps])), 3)},
              "plain_pod": naive,
              "offline_cpu_seconds": round(sum(s["offline_cpus"] for s in steps) * STEP_S, 1)}
    print("day on the real node:", json.dumps(report, indent=1))
    assert all(s["samples"] >= 2 * STEP_S for s in steps)
    # the figure: no minute of the day over the SLO because of offline work
    assert not caused, f"p99 over {SLO_P99_MS} ms beside the batch pod and not alone at hours {caused}"
    # nor, within the SLO, slower by much. On this cgroup v1 host the batch pod runs at cpu.shares 2 on the
    # online pod's cpu (no cpu.idle on v1): a request that wakes while it runs may wait out a scheduler slice
    # (a few ms), so the cost moves with the run's conditions. Medians in the four runs with figures: 0.97,
    # 0.99, 1.006 and 1.324 (CI, 2026-11-29: up to +3.6 ms at p99, every step within the 50 ms SLO); a step
    # 0.63-1.42. The bound is what fails if the batch competed at online's weight: each request would share
    # its cpu half and half with the spinning batch, its service time doubled (2x or more at p99)
    assert report["median_p99_ratio"] <= 1.6, ratios
    # offline work ran through the day: it took what online left of the free cpu, and the node did more
    assert min(s["offline_cpus"] for s in steps) > 0.2, steps
    busy = report["pods_cpu_busy"]
    assert busy["tidal"] > busy["separate_pools"] + 0.2, busy


def _answers(port: int) -> bool:
    try:
        request(port)
        return True
    except (OSError, AssertionError):
        return False


def _settled(label: str) -> bool:
    """the reclaimed workload off probation and not kept off online's idle cpus since"""
    client = AgentClient(AGENT_SOCKET)
    status = client.request("GET", "/v1/status")
    mine = [w["name"] for w in client.request("GET", "/v1/workloads")["workloads"] if w.get("label") == label]
    kept = set(status["kernel_work"]["probation"]) | set(status["kernel_work"]["confined"])
    return bool(mine) and mine[0] not in kept

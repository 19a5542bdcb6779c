"""``tidal bench scheduler``: kube-scheduler and Tidal's scheduler on the same API server and KWOK nodes.

One control plane (``make k8s-testbin``), ``nodes`` KWOK nodes made from real
machines' shapes with the reports their agents would write (``Fleet``); then,
for each scheduler in turn, on the same nodes emptied in between:

1. the scheduler starts, and a probe pod shows it is ready (bound);
2. ``pods`` pods are created (a mix: ``numa_share`` of them dedicated, 2 whole
   cpus bound to one NUMA node, the rest shared, 250 millicores) either
   ``backlog`` (all created while the scheduler is stopped, then it starts:
   its own throughput, whatever rate this API server takes creations at) or
   ``stream`` (created at ``rate`` a second while it runs, Gödel's method:
   latency from creation to binding);
3. a watch records when each pod is first seen bound;
4. figures: pods/s (backlog: over the span of bindings; stream: creation to
   the last binding) and the peak second, p50/p99 of creation-to-binding
   latency, cpu seconds of the API server, etcd, KWOK and the scheduler over
   the run, and the NUMA-bound pods bound where no zone of the node's report
   holds them (every NUMA pod of one node fitted into its zones).

Both schedulers get the same client rate (kube-scheduler's default QPS of 50
would cap it at 50 bindings a second: it is raised to 5,000 here) and their
defaults otherwise. The API server shares this machine's cpus with both; where
the time goes is in ``cpu_seconds``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from common.process import terminate
from common.timing import percentile
from kube.rest import Rest
from cluster.scheduler.fleet import Fleet

NAMESPACE = "sched-bench"
TIDAL = "tidal-scheduler"


def pod_body(name: str, scheduler: str, numa: bool) -> Dict:
    if numa:
        resources = {"requests": {"cpu": "2", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}}
        annotations = {"tidal.io/numa-binding": "true"}
    else:
        resources = {"requests": {"cpu": "250m", "memory": "256Mi"}}
        annotations = {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "annotations": annotations,
                         "labels": {"app": "bench", "numa": str(numa).lower()}},
            "spec": {"schedulerName": scheduler, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "resources": resources}]}}


def _cpu(pid: int) -> float:
    """Cpu seconds of the process and its children (a scheduler's binding processes), alive or reaped."""
    import psutil

    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in proc.children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        return total
    except psutil.Error:
        return 0.0


class BoundWatch(threading.Thread):
    """Records the first time each pod of the namespace is seen with a node."""

    def __init__(self, rest: Rest) -> None:
        super().__init__(name="bench-watch", daemon=True)
        self.rest = rest
        self.bound: Dict[str, float] = {}
        self.nodes: Dict[str, str] = {}
        self.stop = threading.Event()
        self.version = rest.json("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?limit=1")["metadata"]["resourceVersion"]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                for event in self.rest.watch(f"/api/v1/namespaces/{NAMESPACE}/pods", self.version, 30):
                    obj = event.get("object") or {}
                    self.version = (obj.get("metadata") or {}).get("resourceVersion") or self.version
                    node = (obj.get("spec") or {}).get("nodeName")
                    name = (obj.get("metadata") or {}).get("name")
                    if node and name and name not in self.bound:
                        self.bound[name] = time.time()
                        self.nodes[name] = node
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - a broken watch is resumed from the last version
                time.sleep(0.2)


def create_pods(rest: Rest, names: Sequence[str], scheduler: str, numa: Sequence[bool], rate: Optional[float],
                workers: int = 16) -> Dict[str, float]:
    """Create the pods (at ``rate`` a second, else as fast as the API server takes them); their creation times."""
    created: Dict[str, float] = {}
    started = time.monotonic()

    def make(i: int) -> None:
        if rate:
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        body = json.dumps(pod_body(names[i], scheduler, numa[i])).encode()
        stamp = time.time()
        status, answer = rest.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body)
        if status != 201:
            raise RuntimeError(f"creating {names[i]}: {status} {answer[:200]!r}")
        created[names[i]] = stamp

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(make, range(len(names))))
    return created


def delete_pods(rest: Rest, timeout: float = 600.0) -> None:
    """Every pod of the benchmark's namespace, gone (a large collection may take the API server more than
    its own request timeout: the call is made again until nothing is left)."""
    slow = rest.with_timeout(120.0)
    deadline = time.monotonic() + timeout
    while rest.json("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?limit=1")["items"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the benchmark's pods were not deleted")
        try:
            slow.call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods?gracePeriodSeconds=0")
        except OSError:
            pass  # timed out on this side: the server goes on deleting; look again


def numa_infeasible(nodes: Dict[str, str], numa: Dict[str, bool], reports: Dict[str, List[tuple]],
                    need=(2000, 2 << 30)) -> int:
    """NUMA-bound pods bound to a node whose zones cannot hold them all, each inside one zone (all NUMA
    pods have one shape, so filling zones one by one is exact)."""
    per_node: Dict[str, int] = {}
    for name, node in nodes.items():
        if numa.get(name):
            per_node[node] = per_node.get(node, 0) + 1
    bad = 0
    for node, count in per_node.items():
        zones = reports.get(node)
        if not zones:
            bad += count
            continue
        room = sum(min(cpu // need[0], mem // need[1]) for cpu, mem in zones)
        bad += max(0, count - room)
    return bad


class Phase:
    def __init__(self, name: str, start: Callable[[], subprocess.Popen], scheduler_name: str) -> None:
        self.name, self.start, self.scheduler_name = name, start, scheduler_name


def run_phase(plane, fleet: Fleet, phase: Phase, pods: int, numa_share: float, mode: str, rate: Optional[float],
              reports: Dict[str, List[tuple]], progress: Callable[[str], None], timeout: float) -> Dict:
    rest = fleet.rest
    tag = phase.name.replace("-", "")[:8]
    names = [f"{tag}-{i:06d}" for i in range(pods)]
    every = int(round(1 / numa_share)) if numa_share > 0 else 0
    numa = [bool(every) and i % every == every - 1 for i in range(pods)]
    watch = BoundWatch(rest)
    watch.start()
    proc = None
    if mode == "stream":
        proc = _start_and_probe(plane, fleet, phase, watch, progress)
    procs = {n: p.pid for n, p in plane.procs.items() if n in ("kube-apiserver", "etcd", "kwok")}
    before = {n: _cpu(pid) for n, pid in procs.items()}
    progress(f"{phase.name}: creating {pods} pods ({mode}{f', {rate:g}/s' if rate else ''})")
    t0 = time.time()
    created = create_pods(rest, names, phase.scheduler_name, numa, rate if mode == "stream" else None)
    t_created = time.time()
    started = t_created
    if mode == "backlog":  # no probe: it would wait behind the backlog; the first binding says it is up
        proc = phase.start()
        started = time.time()
    scheduler_cpu0 = _cpu(proc.pid)
    if mode == "backlog":
        before = {n: _cpu(pid) for n, pid in procs.items()}
    deadline = time.monotonic() + timeout
    last_report = 0.0
    while True:
        done = sum(1 for n in names if n in watch.bound)
        if done == pods or time.monotonic() > deadline:
            break
        if time.monotonic() - last_report > 5:
            progress(f"{phase.name}: {done}/{pods} bound")
            last_report = time.monotonic()
        time.sleep(0.1)
    t_end = time.time()
    cpu = {n: round(_cpu(pid) - before[n], 2) for n, pid in procs.items()}
    cpu["scheduler"] = round(_cpu(proc.pid) - scheduler_cpu0, 2)
    bound_at = np.array(sorted(watch.bound[n] for n in names if n in watch.bound))
    latency = [watch.bound[n] - created[n] for n in names if n in watch.bound]
    result: Dict = {"pods": pods, "bound": int(len(bound_at)), "mode": mode}
    if len(bound_at):
        if mode == "backlog":
            span = max(1e-6, float(bound_at[-1] - bound_at[0]))
            result["pods_per_s"] = round((len(bound_at) - 1) / span, 1) if len(bound_at) > 1 else 0.0
            result["first_binding_after_start_s"] = round(float(bound_at[0] - started), 2)
        else:
            span = max(1e-6, float(bound_at[-1] - t0))
            result["pods_per_s"] = round(len(bound_at) / span, 1)
            result["creation_per_s"] = round(pods / max(1e-6, t_created - t0), 1)
            result["latency_p50_ms"] = round(percentile(latency, 50) * 1000, 1)
            result["latency_p99_ms"] = round(percentile(latency, 99) * 1000, 1)
        per_second = np.bincount((bound_at - bound_at[0]).astype(np.int64))
        result["peak_pods_per_s"] = int(per_second.max())
        result["span_s"] = round(span, 2)
    result["cpu_seconds"] = cpu
    result["numa_bound_pods"] = int(sum(numa))
    result["numa_infeasible"] = numa_infeasible(watch.nodes, dict(zip(names, numa)), reports)
    watch.stop.set()
    terminate(proc, timeout=20)
    plane.procs.pop(phase.name, None)
    progress(f"{phase.name}: {result.get('pods_per_s')} pods/s; deleting its pods")
    delete_pods(rest)
    return result


def _start_and_probe(plane, fleet: Fleet, phase: Phase, watch: BoundWatch, progress) -> subprocess.Popen:
    proc = phase.start()
    probe = f"probe-{phase.name}-{int(time.time())}"
    create_pods(fleet.rest, [probe], phase.scheduler_name, [False], None)
    deadline = time.monotonic() + 180
    while probe not in watch.bound:
        if proc.poll() is not None:
            raise RuntimeError(f"{phase.name} exited ({proc.returncode}); see {plane.dir}/{phase.name}.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{phase.name} did not bind a probe pod in 180 s; see {plane.dir}/{phase.name}.log")
        time.sleep(0.1)
    fleet.rest.call("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{probe}?gracePeriodSeconds=0")
    progress(f"{phase.name}: ready")
    return proc


def kube_scheduler_phase(plane) -> Phase:
    from kube.localplane import free_port

    def start() -> subprocess.Popen:
        config = f"{plane.dir}/kube-scheduler-bench.yaml"
        with open(config, "w") as handle:
            # the client rate: kube-scheduler's default (QPS 50, burst 100) would cap it at 50 bindings a second
            handle.write("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
                         f"clientConnection: {{kubeconfig: {plane.kubeconfig()}, qps: 5000, burst: 5000}}\n"
                         "leaderElection: {leaderElect: false}\n")
        return plane._spawn("kube-scheduler", [f"{plane.bin}/kube-scheduler", f"--config={config}",
                                               f"--secure-port={free_port()}", "--bind-address=127.0.0.1", "--v=1"])

    return Phase("kube-scheduler", start, "default-scheduler")


def tidal_phase(plane, shards: int = 1, extra: Sequence[str] = ()) -> Phase:
    def start() -> subprocess.Popen:
        # --stale-after: no agent runs on a KWOK node to refresh its report, which was written when the
        # fleet was made; the shipped 120 s would distrust every report of a long run
        argv = [sys.executable, "-m", "agent.cli", "cluster", "scheduler", f"--kubeconfig={plane.kubeconfig()}",
                "--no-leader-elect", "--metrics-port=0", f"--shards={shards}", "--stale-after=86400", *extra]
        return plane._spawn(name, argv)

    # the name tags the phase's pods: each shard count its own
    name = "tidal-scheduler" if shards == 1 else f"tidal{shards}-scheduler"
    return Phase(name, start, TIDAL)


def run(shapes: Sequence[Dict], nodes: int, pods: int, mode: str = "backlog", rate: Optional[float] = None,
        numa_share: float = 0.1, shards: Sequence[int] = (1,), schedulers: Sequence[str] = ("kube-scheduler", "tidal"),
        progress: Callable[[str], None] = lambda _: None, timeout: Optional[float] = None) -> Dict:
    from kube.localplane import ControlPlane
    from cluster.scheduler.fleet import kwok_testbin

    binaries, kwok = kwok_testbin("tidal bench scheduler")
    plane = ControlPlane(binaries, json_storage=False).start()
    try:
        fleet = Fleet(plane, kwok)
        fleet.install_crds()
        fleet.namespace(NAMESPACE)
        started = time.monotonic()
        names = fleet.add_nodes(nodes, shapes, progress=progress)
        made_s = time.monotonic() - started
        fleet.start_kwok()
        fleet.wait_ready(names)
        progress(f"{nodes} nodes ready ({made_s:.0f}s to create)")
        reports = {}
        for i, name in enumerate(names):
            zones = shapes[i % len(shapes)]["nrt"]["zones"]
            reports[name] = [_zone_free(z) for z in zones]
        out: Dict = {"nodes": nodes, "pods": pods, "mode": mode, "rate": rate, "numa_share": numa_share,
                     "shapes": [s["name"] for s in shapes], "node_creation_s": round(made_s, 1),
                     "machine": {"cpus": os.cpu_count()}, "results": {}}
        phases = []
        for name in schedulers:
            if name == "kube-scheduler":
                phases.append((name, kube_scheduler_phase(plane), None))
            else:  # one run per shard count asked, side by side (the first is "tidal")
                for i, count in enumerate(shards):
                    phases.append(("tidal" if i == 0 else f"tidal-shards-{count}", tidal_phase(plane, count), count))
        for name, phase, count in phases:
            out["results"][name] = run_phase(plane, fleet, phase, pods, numa_share, mode, rate, reports, progress,
                                             timeout or max(300.0, pods / 20))
            if count is not None:
                out["results"][name]["shards"] = count
        got = out["results"]
        if "kube-scheduler" in got and "tidal" in got and got["kube-scheduler"].get("pods_per_s"):
            out["ratio"] = round(got["tidal"].get("pods_per_s", 0) / got["kube-scheduler"]["pods_per_s"], 2)
        fleet.stop()
        return out
    finally:
        plane.stop()


def _zone_free(zone: Dict) -> tuple:
    from contracts.pods import quantity

    free = {r["name"]: r["available"] for r in zone["resources"]}
    return int(quantity(free.get("cpu", "0")) * 1000), int(quantity(free.get("memory", "0")))

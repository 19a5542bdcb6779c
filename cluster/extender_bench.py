"""``tidal bench extender``: filter + prioritize latency per scheduling cycle with N candidate nodes.

The extender is served on loopback, in a process of its own, and called as
kube-scheduler calls it: by a small Go client (``benchclient``, built with
the machine's Go; a Python client when there is no Go) over HTTP,
JSON ``ExtenderArgs`` with ``NodeNames``, keep-alive); its cache holds one
report per node (shapes drawn from the hwloc machines and three server
shapes). Each sample is one ``/filter`` call with every node as a candidate
plus one ``/prioritize`` call with the nodes that passed, timed together,
over a mix of NUMA-bound dedicated, shared and reclaimed pods. The Go client
encodes and decodes every body, as the scheduler does.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from typing import Any, Dict, List, Optional

from agent.bench.timing import percentile
from cluster.extender import TopologyCache, serve
from cluster.placement.workload import make_cluster


def _pods(seed: int) -> List[Dict[str, Any]]:
    rng = random.Random(seed)
    pods = []
    for i in range(30):
        kind = i % 3
        if kind == 0:
            cpus = rng.choice((2, 4, 8))
            pod = {"metadata": {"name": f"db-{i}", "namespace": "bench", "uid": f"u{i}",
                                "annotations": {"tidal.io/numa-binding": "true"}},
                   "spec": {"containers": [{"name": "c", "resources": {
                       "requests": {"cpu": str(cpus), "memory": f"{cpus * 2}Gi"},
                       "limits": {"cpu": str(cpus), "memory": f"{cpus * 2}Gi"}}}]}}
        elif kind == 1:
            pod = {"metadata": {"name": f"web-{i}", "namespace": "bench", "uid": f"u{i}"},
                   "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "500m",
                                                                                    "memory": "1Gi"}}}]}}
        else:
            pod = {"metadata": {"name": f"batch-{i}", "namespace": "bench", "uid": f"u{i}"},
                   "spec": {"containers": [{"name": "c", "resources": {"requests": {
                       "cpu": "100m", "tidal.io/reclaimed-millicpu": "2000", "memory": "2Gi"}}}]}}
        pods.append(pod)
    return pods


def _serve(nodes: int, seed: int, ready) -> None:
    """The extender's process (kube-scheduler calls it from another process too)."""
    cache = TopologyCache(stale_after=3600)
    for report in make_cluster(nodes, seed=seed, now=time.time()):
        cache.put(report)
    times: List[float] = []
    server = serve(cache, 0, handler_times=times)
    ready.send((server.server_address[1], sorted(cache.reports)))
    while ready.recv() != "done":  # "server-times": what each call took inside the extender
        ready.send(list(times))
    server.shutdown()


def _go_client() -> Optional[str]:
    """Build benchclient (Go: kube-scheduler's own HTTP/JSON stack) once; ``None`` without Go."""
    import os
    import shutil
    import subprocess
    import tempfile

    go = shutil.which("go")
    if go is None:
        return None
    source = os.path.join(os.path.dirname(__file__), "benchclient")
    target = os.path.join(tempfile.gettempdir(), f"tidal-benchclient-{os.getuid()}")
    newest = max(os.path.getmtime(os.path.join(source, f)) for f in os.listdir(source))
    if not os.path.exists(target) or os.path.getmtime(target) < newest:
        done = subprocess.run([go, "build", "-o", target, "."], cwd=source, capture_output=True, text=True)
        if done.returncode != 0:
            return None
    return target


def run(nodes: int = 5000, calls: int = 300, seed: int = 1, client: str = "auto") -> Dict[str, Any]:
    """``client``: "go" (kube-scheduler's language and HTTP stack), "python", or "auto" (Go if built)."""
    import multiprocessing
    import subprocess
    import tempfile

    context = multiprocessing.get_context("fork")
    here, there = context.Pipe()
    child = context.Process(target=_serve, args=(nodes, seed, there), daemon=True)
    child.start()
    port, names = here.recv()
    pods = _pods(seed)
    binary = _go_client() if client in ("auto", "go") else None
    try:
        if binary is not None:
            with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
                json.dump({"NodeNames": names, "Pods": pods}, handle)
                handle.flush()
                done = subprocess.run([binary, "-url", f"http://127.0.0.1:{port}", "-args", handle.name,
                                       "-calls", str(calls)], capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"benchclient: {done.stderr.strip()[:300]}")
            data = json.loads(done.stdout)
            samples, passed, http_ms = data["samples_ms"], data["passed"], data["http_ms"]
            server: List[float] = []
            used = "go (net/http, encoding/json: as kube-scheduler calls it)"
        else:
            samples, passed, server = _python_client(port, names, pods, calls)
            http_ms = samples
            used = "python (http.client, json)"
        here.send("server-times")
        server = here.recv() if not server else server
    finally:
        here.send("done")
        child.join(timeout=10)
    server = server[-2 * calls:]
    per_call = [a + b for a, b in zip(server[0::2], server[1::2])]
    return {"nodes": nodes, "calls": calls, "client": used,
            "p50_ms": round(percentile(http_ms, 50), 3), "p99_ms": round(percentile(http_ms, 99), 3),
            "max_ms": round(max(http_ms), 3),
            "with_client_json_p50_ms": round(percentile(samples, 50), 3),
            "with_client_json_p99_ms": round(percentile(samples, 99), 3),
            "server_p50_ms": round(percentile(per_call, 50), 3), "server_p99_ms": round(percentile(per_call, 99), 3),
            "target_p99_ms": 10, "met": percentile(http_ms, 99) < 10,
            "nodes_passed_median": sorted(passed)[len(passed) // 2],
            "measures": "per scheduling cycle: one /filter (all nodes as candidates) + one /prioritize (the nodes "
                        "that passed). p*_ms: request sent to response read, both calls (the extender and the "
                        "wire); with_client_json_*: plus the client encoding the requests and decoding the "
                        "answers (the scheduler's own work); server_*: the time inside the extender"}


def _python_client(port: int, names: List[str], pods: List[Dict[str, Any]], calls: int):
    import gc

    conn = http.client.HTTPConnection("127.0.0.1", port)
    handler_ms: List[float] = []

    def post(verb: str, body: Dict[str, Any], parse: bool = True) -> Any:
        conn.request("POST", f"/{verb}", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
        handler_ms.append(float(response.getheader("X-Tidal-Handler-Ms", "nan")))
        return json.loads(raw) if parse else raw

    gc.freeze()  # the client stands in for kube-scheduler (Go): keep Python's GC out of its side
    samples, passed = [], []
    try:
        for i in range(calls + 10):
            pod = pods[i % len(pods)]
            start = time.perf_counter()
            result = post("filter", {"Pod": pod, "Nodes": None, "NodeNames": names})
            scores = post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": result["NodeNames"]}, parse=False)
            elapsed = (time.perf_counter() - start) * 1000
            if i == 0:
                checked = json.loads(scores)
                assert len(checked) == len(result["NodeNames"]) and all(0 <= h["Score"] <= 10 for h in checked)
            if i >= 10:  # warm-up: the first calls build the view
                samples.append(elapsed)
                passed.append(len(result["NodeNames"]))
    finally:
        conn.close()
    return samples, passed, handler_ms[-2 * calls:]

"""``tidal bench extender``: filter + prioritize latency per scheduling cycle with N candidate nodes.

The extender is served on loopback, in a process of its own, exactly as
kube-scheduler calls it (HTTP,
JSON ``ExtenderArgs`` with ``NodeNames``, keep-alive); its cache holds one
report per node (shapes drawn from the hwloc machines and three server
shapes). Each sample is one ``/filter`` call with every node as a candidate
plus one ``/prioritize`` call with the nodes that passed, timed together,
over a mix of NUMA-bound dedicated, shared and reclaimed pods. The client
encodes both requests and decodes the filter result (it needs the names);
the prioritize answer is read, not decoded (kube-scheduler decodes it in Go).
"""

from __future__ import annotations

import http.client
import json
import random
import time
from typing import Any, Dict, List

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
    server = serve(cache, 0)
    ready.send((server.server_address[1], sorted(cache.reports)))
    ready.recv()  # until the benchmark is done
    server.shutdown()


def run(nodes: int = 5000, calls: int = 300, seed: int = 1) -> Dict[str, Any]:
    import multiprocessing

    context = multiprocessing.get_context("fork")
    here, there = context.Pipe()
    child = context.Process(target=_serve, args=(nodes, seed, there), daemon=True)
    child.start()
    port, names = here.recv()
    conn = http.client.HTTPConnection("127.0.0.1", port)

    handler_ms: List[float] = []

    def post(verb: str, body: Dict[str, Any], parse: bool = True) -> Any:
        data = json.dumps(body)
        conn.request("POST", f"/{verb}", data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
        handler_ms.append(float(response.getheader("X-Tidal-Handler-Ms", "nan")))
        return json.loads(raw) if parse else raw

    pods = _pods(seed)
    samples, passed, server = [], [], []
    import gc

    gc.freeze()  # the client stands in for kube-scheduler (Go): keep Python's GC out of its side
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
                server.append(handler_ms[-1] + handler_ms[-2])
                passed.append(len(result["NodeNames"]))
    finally:
        conn.close()
        here.send("done")
        child.join(timeout=10)
    return {"nodes": nodes, "calls": calls, "p50_ms": round(percentile(samples, 50), 3),
            "p99_ms": round(percentile(samples, 99), 3), "max_ms": round(max(samples), 3),
            "server_p50_ms": round(percentile(server, 50), 3), "server_p99_ms": round(percentile(server, 99), 3),
            "target_p99_ms": 10, "met": percentile(samples, 99) < 10,
            "nodes_passed_median": sorted(passed)[len(passed) // 2],
            "measures": "p*_ms: one /filter (all nodes as candidates) + one /prioritize (the nodes that passed), "
                        "round trip over HTTP on loopback from a Python client; server_*: the time inside the "
                        "extender for the two (X-Tidal-Handler-Ms)"}

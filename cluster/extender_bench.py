"""``tidal bench extender``: filter + prioritize latency per scheduling cycle with N candidate nodes.

The extender is served on loopback, in a process of its own, and called as
kube-scheduler calls it: by a small Go client (``benchclient``, built with
the machine's Go; a Python client when there is no Go) over HTTP,
JSON ``ExtenderArgs`` with ``NodeNames``, keep-alive); its cache holds one
report per node (shapes drawn from the hwloc machines and three server
shapes). Each sample is one ``/filter`` call with every node as a candidate
plus one ``/prioritize`` call with the nodes that passed, timed together,
over a mix of NUMA-bound dedicated, shared and reclaimed pods. After each
sample the client binds the pod to its best node through ``/bind`` (untimed,
as kube-scheduler binds asynchronously), so the extender's view changes
every cycle as it does under a real scheduling burst. The Go client encodes
and decodes every body, as the scheduler does.

Side by side, in rounds that take turns, the same client calls a *canned*
server: the same HTTP server code answering the same answers from memory.
Its latency is what the wire and the two HTTP stacks cost on this machine
with no extender work at all; the extender's figures are read against it.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from typing import Any, Dict, List, Optional, Tuple

from common.timing import percentile
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
    """The extender's process (kube-scheduler calls it from another process too), with the canned
    server beside it."""
    cache = TopologyCache(stale_after=3600)
    for report in make_cluster(nodes, seed=seed, now=time.time()):
        cache.put(report)
    names = sorted(cache.reports)
    pods = _pods(seed)
    canned = _canned_answers(cache, names, pods)
    times: List[Tuple[str, float]] = []
    by_name = {pod["metadata"]["name"]: pod for pod in pods}
    bound: List[str] = []

    def bind(namespace: str, name: str, uid: str, node: str) -> None:  # as the API would, minus the API
        bound.append(node)

    server = serve(cache, 0, handler_times=times, binding=(bind, lambda namespace, name: by_name[name]))
    floor = _serve_canned(canned)
    ready.send((server.server_address[1], floor.server_address[1], names))
    while ready.recv() != "done":  # "server-times": what each call took inside the extender
        ready.send((list(times), len(bound)))
    server.shutdown()
    floor.shutdown()


def _canned_answers(cache: TopologyCache, names: List[str],
                    pods: List[Dict[str, Any]]) -> Dict[bytes, Tuple[bytes, bytes]]:
    """Per pod name: the extender's filter and prioritize answers for that pod."""
    answers = {}
    for pod in pods:
        filtered = cache.filter_json(pod, list(names))
        answers[pod["metadata"]["name"].encode()] = (
            filtered, cache.prioritize_json(pod, json.loads(filtered)["NodeNames"]))
    return answers


def _serve_canned(answers: Dict[bytes, Tuple[bytes, bytes]]):
    """The baseline: the same HTTP server code answering from memory, picked by the pod's name (the
    first ``"name"`` after ``"Pod"``: the bench's pods have no other)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Canned(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path in ("/filter", "/prioritize"):
                at = raw.find(b'"name":"', raw.find(b'"Pod":')) + 8
                data = answers[raw[at:raw.find(b'"', at)]][self.path == "/prioritize"]
            else:
                data = b'{"Error":""}'
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % len(data) + data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="canned-http", daemon=True).start()
    return server


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


def _round(binary: Optional[str], port: int, names: List[str], pods: List[Dict[str, Any]], calls: int,
           warmup: int) -> Dict[str, List[float]]:
    """One client run: per sample the whole cycle, its HTTP part, and the nodes passed."""
    import subprocess
    import tempfile

    if binary is None:
        return _python_client(port, names, pods, calls, warmup)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump({"NodeNames": names, "Pods": pods}, handle)
        handle.flush()
        done = subprocess.run([binary, "-url", f"http://127.0.0.1:{port}", "-args", handle.name,
                               "-calls", str(calls), "-warmup", str(warmup)],
                              capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"benchclient: {done.stderr.strip()[:300]}")
    data = json.loads(done.stdout)
    return {"samples": data["samples_ms"], "http": data["http_ms"], "passed": data["passed"]}


def run(nodes: int = 5000, calls: int = 300, seed: int = 1, client: str = "auto", rounds: int = 3) -> Dict[str, Any]:
    """``client``: "go" (kube-scheduler's language and HTTP stack), "python", or "auto" (Go if built).
    ``calls`` samples per server, taken in ``rounds`` turns with the canned server between."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    here, there = context.Pipe()
    child = context.Process(target=_serve, args=(nodes, seed, there), daemon=True)
    child.start()
    port, canned_port, names = here.recv()
    pods = _pods(seed)
    binary = _go_client() if client in ("auto", "go") else None
    if client == "go" and binary is None:
        raise RuntimeError("bench extender --client go: no Go toolchain to build the client with")
    per_round = max(1, calls // rounds)
    warmup = len(pods)  # one pass over the pod shapes: the first calls build the view
    runs: Dict[str, Dict[str, List[float]]] = {"tidal": {}, "canned": {}}
    try:
        for _ in range(rounds):
            for name, target in (("tidal", port), ("canned", canned_port)):
                got = _round(binary, target, names, pods, per_round, warmup)
                for key, values in got.items():
                    runs[name].setdefault(key, []).extend(values)
        here.send("server-times")
        server, bound = here.recv()
    finally:
        here.send("done")
        child.join(timeout=10)
    calls_in = [ms for path, ms in server if path in ("/filter", "/prioritize")]
    per_cycle = [a + b for a, b in zip(calls_in[0::2], calls_in[1::2])]
    tidal, canned = runs["tidal"], runs["canned"]
    p99 = percentile(tidal["http"], 99)
    floor_p99 = percentile(canned["http"], 99)
    return {"nodes": nodes, "calls": len(tidal["http"]), "rounds": rounds,
            "client": "go (net/http, encoding/json: as kube-scheduler calls it)" if binary
            else "python (http.client, json)",
            "p50_ms": round(percentile(tidal["http"], 50), 3), "p99_ms": round(p99, 3),
            "max_ms": round(max(tidal["http"]), 3),
            "with_client_json_p50_ms": round(percentile(tidal["samples"], 50), 3),
            "with_client_json_p99_ms": round(percentile(tidal["samples"], 99), 3),
            "server_p50_ms": round(percentile(per_cycle, 50), 3), "server_p99_ms": round(percentile(per_cycle, 99), 3),
            "server_by_verb": {path.strip("/"): {"p50_ms": round(percentile(ms, 50), 3),
                                                 "p99_ms": round(percentile(ms, 99), 3)}
                               for path, ms in _by_path(server).items()},
            "canned": {"p50_ms": round(percentile(canned["http"], 50), 3), "p99_ms": round(floor_p99, 3),
                       "with_client_json_p99_ms": round(percentile(canned["samples"], 99), 3)},
            "p99_over_canned": round(p99 / floor_p99, 2) if floor_p99 else None,
            "binds": bound,
            "target_p99_ms": 10, "met": p99 < 10,
            "nodes_passed_median": sorted(tidal["passed"])[len(tidal["passed"]) // 2],
            "measures": "per scheduling cycle: one /filter (all nodes as candidates) + one /prioritize (the nodes "
                        "that passed), then an untimed /bind to the best node. p*_ms: request sent to response "
                        "read, both calls (the extender and the wire); with_client_json_*: plus the client "
                        "encoding the requests and decoding the answers (the scheduler's own work); server_*: "
                        "the time inside the extender; canned: the same client and HTTP server answering the "
                        "same bytes from memory, in alternating rounds (this machine's floor)"}


def _by_path(times: List[Tuple[str, float]]) -> Dict[str, List[float]]:
    grouped: Dict[str, List[float]] = {}
    for path, ms in times:
        grouped.setdefault(path, []).append(ms)
    return grouped


def _python_client(port: int, names: List[str], pods: List[Dict[str, Any]], calls: int, warmup: int):
    import gc

    conn = http.client.HTTPConnection("127.0.0.1", port)

    def post(verb: str, body: Dict[str, Any], parse: bool = True) -> Any:
        conn.request("POST", f"/{verb}", json.dumps(body, separators=(",", ":")),
                     {"Content-Type": "application/json"})
        raw = conn.getresponse().read()
        return json.loads(raw) if parse else raw

    gc.freeze()  # the client stands in for kube-scheduler (Go): keep Python's GC out of its side
    samples, passed = [], []
    try:
        for i in range(calls + warmup):
            pod = pods[i % len(pods)]
            start = time.perf_counter()
            result = post("filter", {"Pod": pod, "Nodes": None, "NodeNames": names})
            scores = json.loads(post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": result["NodeNames"]},
                                     parse=False))
            elapsed = (time.perf_counter() - start) * 1000
            candidates = set(result["NodeNames"])
            if not all(h["Host"] in candidates and 0 <= h["Score"] <= 10 for h in scores):
                raise RuntimeError("prioritize scored a node that was not a candidate, or out of 0..10")
            if result["NodeNames"]:
                best = max(scores, key=lambda h: h["Score"])["Host"] if scores else result["NodeNames"][0]
                meta = pod["metadata"]
                post("bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"],
                              "Node": best})
            if i >= warmup:
                samples.append(elapsed)
                passed.append(len(result["NodeNames"]))
    finally:
        conn.close()
    return {"samples": samples, "http": samples, "passed": passed}

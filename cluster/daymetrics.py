"""The online pods' cpu use for the HorizontalPodAutoscaler of a compressed day (``cluster.day``).

The HPA reads a pod's cpu from the resource metrics API, ``metrics.k8s.io``, which a cluster serves through
the API server's aggregation layer (metrics-server, usually, from each kubelet's summary). A KWOK node has no
kubelet and its pods use nothing, so metrics-server would have nothing to read. ``DayMetrics`` serves that
API itself with what the day says the pods use: each minute the day driver tells it the online pods serving
and online's demand (cores), and each pod is shown using ``demand / pods`` (a Service spreads the load evenly
over the ready pods). The HPA itself, its controller, its behaviour and its arithmetic are Kubernetes' own.

Registered as metrics-server is (an ``APIService`` for ``v1beta1.metrics.k8s.io``) but behind a Service of type
ExternalName, ``localhost``: the aggregator resolves such a Service to its name, where Endpoints of a Service
may not hold a loopback address (and nothing here routes a ClusterIP). TLS is this server's own
certificate, the ``APIService`` skipping its verification (``insecureSkipTLSVerify``), as metrics-server's
own manifest registers it.

When a minute's measurement is missing (``update(pods, None, minute)``: a scrape that failed, a source
down), the same minute of yesterday stands in, spread over today's pods, where the source has it (what it
showed then, or what it was told yesterday looked like: ``remember``); otherwise it shows nothing, and the
HPA holds its replicas as it does when metrics-server has nothing (``ScalingActive`` false), however the
load moves meanwhile.

What a pod's metric says, so that the HPA counts it the minute the day does: ``timestamp`` now (to the
microsecond) and a ``window`` of 1 ms. The HPA ignores a started pod's cpu while its metric's window began
before the pod became Ready; metrics-server's 15 s window would, at a day minute of a fraction of a second,
hide every new replica for tens of day minutes.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional, Sequence, Tuple
from urllib.parse import parse_qs, urlsplit

GROUP, VERSION = "metrics.k8s.io", "v1beta1"
APISERVICE = f"{VERSION}.{GROUP}"
SERVICE = "tidal-day-metrics"
PREFIX = f"/apis/{GROUP}/{VERSION}"
WINDOW = "1ms"
DAY = 24 * 60


def parse_selector(text: str) -> Dict[str, str]:
    """``k=v,k2==v2`` (what an HPA sends for a Deployment's matchLabels); anything else is refused."""
    out: Dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.replace("==", "=").partition("=")
        if not sep or not key or "!" in key or " " in key:
            raise ValueError(f"label selector {text!r}: only key=value terms are served")
        out[key] = value
    return out


class DayMetrics:
    """``update(pods, demand)`` each day minute; ``start(cert, key)`` serves; ``register(rest)`` makes the API
    server route ``metrics.k8s.io`` here."""

    def __init__(self, namespace: str, labels: Dict[str, str], container: str = "web",
                 fallback: bool = True) -> None:
        self.namespace, self.labels, self.container, self.fallback = namespace, dict(labels), container, fallback
        self._lock = threading.Lock()
        self._use: Dict[str, int] = {}  # pod -> millicpu
        self._seen: Dict[int, float] = {}  # day minute -> the demand shown (or remembered)
        self.requests = 0  # lists served (the HPA reads once per sync)
        self.fallback_minutes = 0  # minutes yesterday's figure stood in
        self.missing_minutes = 0  # minutes nothing was shown
        self._server: Optional[ThreadingHTTPServer] = None

    def remember(self, minute: int, demand_cores: float) -> None:
        """What the demand was at day minute ``minute`` (negative: before today), for a later minute's
        fallback; a figure the source showed itself is not replaced."""
        self._seen.setdefault(int(minute), float(demand_cores))

    def update(self, pods: Sequence[str], demand_cores: Optional[float], minute: Optional[int] = None) \
            -> Optional[float]:
        """The pods serving this minute, sharing ``demand_cores`` evenly; ``None``: the minute's measurement is
        missing, and yesterday's same minute stands in (if known and ``fallback``), else nothing is shown.
        Returns the demand shown (``None``: none)."""
        if demand_cores is None:
            demand_cores = self._seen.get(minute - DAY) if minute is not None and self.fallback else None
            if demand_cores is None:
                self.missing_minutes += 1
                with self._lock:
                    self._use = {}
                return None
            self.fallback_minutes += 1
        elif minute is not None:
            self._seen[minute] = float(demand_cores)
        share = int(round(1000.0 * max(0.0, float(demand_cores)) / len(pods))) if pods else 0
        with self._lock:
            self._use = {name: share for name in pods}
        return float(demand_cores)

    def pod_metrics(self, selector: Dict[str, str], name: Optional[str] = None) -> Dict[str, Any]:
        if any(self.labels.get(k) != v for k, v in selector.items()):
            return {"kind": "PodMetricsList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {}, "items": []}
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        with self._lock:
            use = dict(self._use)
        items = [{"metadata": {"name": pod, "namespace": self.namespace, "labels": self.labels}, "timestamp": now,
                  "window": WINDOW, "containers": [{"name": self.container,
                                                    "usage": {"cpu": f"{milli}m", "memory": "64Mi"}}]}
                 for pod, milli in sorted(use.items()) if name is None or pod == name]
        if name is not None:
            return dict(items[0], kind="PodMetrics", apiVersion=f"{GROUP}/{VERSION}") if items else {}
        return {"kind": "PodMetricsList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {}, "items": items}

    def answer(self, method: str, target: str) -> Tuple[int, Dict[str, Any]]:
        """(status, body) for one request: discovery, the pods' metrics (a namespace's, all, one), nodes (none)."""
        if method != "GET":
            return 405, _status(405, f"{method} is not served")
        url = urlsplit(target)
        path = url.path.rstrip("/")
        if path in ("/openapi/v2", "/openapi/v3"):  # the aggregator merges each server's schema
            return 200, {"swagger": "2.0", "info": {"title": SERVICE, "version": VERSION}, "paths": {}} \
                if path.endswith("v2") else {"paths": {}}
        if path == PREFIX:
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{VERSION}",
                         "resources": [{"name": "pods", "singularName": "", "namespaced": True, "kind": "PodMetrics",
                                        "verbs": ["get", "list"]},
                                       {"name": "nodes", "singularName": "", "namespaced": False,
                                        "kind": "NodeMetrics", "verbs": ["get", "list"]}]}
        try:
            selector = parse_selector((parse_qs(url.query).get("labelSelector") or [""])[0])
        except ValueError as exc:
            return 400, _status(400, str(exc))
        parts = path[len(PREFIX):].strip("/").split("/") if path.startswith(PREFIX + "/") else []
        if parts == ["nodes"]:
            return 200, {"kind": "NodeMetricsList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {}, "items": []}
        if parts == ["pods"] or (len(parts) == 3 and parts[0] == "namespaces" and parts[2] == "pods"):
            if len(parts) == 3 and parts[1] != self.namespace:
                return 200, {"kind": "PodMetricsList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {},
                             "items": []}
            with self._lock:
                self.requests += 1
            return 200, self.pod_metrics(selector)
        if len(parts) == 4 and parts[0] == "namespaces" and parts[2] == "pods":
            found = self.pod_metrics({}, parts[3]) if parts[1] == self.namespace else {}
            return (200, found) if found else (404, _status(404, f"podmetrics {parts[3]!r} not found"))
        return 404, _status(404, f"{url.path} is not served here")

    def start(self, cert: str, key: str, host: str = "127.0.0.1") -> int:
        """Serves HTTPS on a free port of ``host`` (returned), in a thread."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                status, body = metrics.answer("GET", self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, name="day-metrics", daemon=True).start()
        return self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def register(self, rest, port: int, timeout: float = 60.0) -> None:
        """The Service (ExternalName ``localhost``) and the ``APIService``; returns once the aggregator
        reports it Available."""
        rest.json("POST", f"/api/v1/namespaces/{self.namespace}/services", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": SERVICE, "namespace": self.namespace},
            "spec": {"type": "ExternalName", "externalName": "localhost"}})
        rest.json("POST", "/apis/apiregistration.k8s.io/v1/apiservices", {
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
            "spec": {"group": GROUP, "version": VERSION, "groupPriorityMinimum": 100, "versionPriority": 100,
                     "insecureSkipTLSVerify": True,
                     "service": {"namespace": self.namespace, "name": SERVICE, "port": port}}})
        deadline, last = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            last = rest.json("GET", f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}")
            if any(c.get("type") == "Available" and c.get("status") == "True"
                   for c in (last.get("status") or {}).get("conditions") or []):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the {APISERVICE} APIService was not Available after {timeout:g} s: "
                           f"{(last.get('status') or {}).get('conditions')}")

    def unregister(self, rest) -> None:
        rest.json("DELETE", f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}", ok=(200, 202, 404))
        rest.json("DELETE", f"/api/v1/namespaces/{self.namespace}/services/{SERVICE}", ok=(200, 202, 404))


def _status(code: int, message: str) -> Dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}


def hpa(namespace: str, target: str, target_utilization: float, max_replicas: int, down_window_s: int,
        min_replicas: int = 1) -> Dict[str, Any]:
    """An ``autoscaling/v2`` HorizontalPodAutoscaler on the Deployment ``target``'s cpu, its behaviour scaled to
    a compressed day: scale-down stabilised over ``down_window_s`` (the default 300 s is 5 minutes of a real
    day), scale-up at once and unbounded (the default's "double each 15 s" is, in a day's minutes, no bound)."""
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": target, "namespace": namespace},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                     "minReplicas": min_replicas, "maxReplicas": max_replicas,
                     "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                         "type": "Utilization", "averageUtilization": int(round(target_utilization * 100))}}}],
                     "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                                              "policies": [{"type": "Percent", "value": 1000, "periodSeconds": 1}]},
                                  "scaleDown": {"stabilizationWindowSeconds": int(down_window_s), "selectPolicy": "Max",
                                                "policies": [{"type": "Percent", "value": 100, "periodSeconds": 1}]}}}}

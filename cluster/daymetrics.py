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

import ssl
import threading
import time
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence

from cluster.metricsapi import APISERVICE, GROUP, VERSION, ResourceMetricsAPI, matches, parse_selector  # noqa: F401

SERVICE = "tidal-day-metrics"
WINDOW = "1ms"
DAY = 24 * 60


class DayMetrics(ResourceMetricsAPI):
    """``update(pods, demand)`` each day minute; ``start(cert, key)`` serves; ``register(rest)`` makes the API
    server route ``metrics.k8s.io`` here."""

    def __init__(self, namespace: str, labels: Dict[str, str], container: str = "web",
                 fallback: bool = True) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.namespace, self.labels, self.container, self.fallback = namespace, dict(labels), container, fallback
        self._use: Dict[str, int] = {}  # pod -> millicpu
        self._seen: Dict[int, float] = {}  # day minute -> the demand shown (or remembered)
        self.fallback_minutes = 0  # minutes yesterday's figure stood in
        self.missing_minutes = 0  # minutes nothing was shown

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

    def pod_items(self, namespace: Optional[str], selector: Dict[str, str],
                  name: Optional[str] = None) -> List[Dict[str, Any]]:
        if (namespace is not None and namespace != self.namespace) or not matches(self.labels, selector):
            return []
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        with self._lock:
            use = dict(self._use)
        return [{"metadata": {"name": pod, "namespace": self.namespace, "labels": self.labels}, "timestamp": now,
                 "window": WINDOW, "containers": [{"name": self.container,
                                                   "usage": {"cpu": f"{milli}m", "memory": "64Mi"}}]}
                for pod, milli in sorted(use.items()) if name is None or pod == name]

    def start(self, cert: str, key: str, host: str = "127.0.0.1") -> int:
        """Serves HTTPS on a free port of ``host`` (returned), in a thread."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        return self.serve(context, host)

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

"""The resource metrics API (``metrics.k8s.io/v1beta1``) as an aggregated API server: the routes, the
answers and the HTTPS, for any source of figures.

What the HorizontalPodAutoscaler and ``kubectl top`` read: ``PodMetrics`` (each pod's containers' cpu and
memory, with the time they were read and the window they span) and ``NodeMetrics``, listed by namespace and
label selector or fetched by name. The API server reaches it through an ``APIService`` (the aggregation
layer), as it reaches metrics-server; a source subclasses ``ResourceMetricsAPI`` and answers ``pod_items`` and
``node_items``: ``cluster.podmetrics`` (the agents' measured use, ``tidal cluster metrics``) and
``cluster.daymetrics`` (a compressed day's demand curve).
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("tidal.metrics")
GROUP, VERSION = "metrics.k8s.io", "v1beta1"
APISERVICE = f"{VERSION}.{GROUP}"
PREFIX = f"/apis/{GROUP}/{VERSION}"
API_VERSION = f"{GROUP}/{VERSION}"
IO_TIMEOUT = 10.0  # seconds a caller may stay silent mid-request (the aggregator sends at once)
MAX_INFLIGHT = 64  # requests answered at once; an HPA controller sends one per autoscaler per sync


def parse_selector(text: str) -> Dict[str, str]:
    """``k=v,k2==v2`` (what an HPA sends for a Deployment's matchLabels); anything else is refused."""
    out: Dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.replace("==", "=").partition("=")
        if not sep or not key or "!" in key or " " in key:
            raise ValueError(f"label selector {text!r}: only key=value terms are served")
        out[key] = value
    return out


def status(code: int, message: str) -> Dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code}


def matches(labels: Dict[str, str], selector: Dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _list(kind: str, items: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"kind": kind, "apiVersion": API_VERSION, "metadata": {}, "items": items}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A caller that failed the handshake or went silent: a debug line, not a traceback on stderr."""
        import sys

        log.debug("metrics API: %s from %s", sys.exc_info()[1], client_address)


class ResourceMetricsAPI:
    """``answer(method, target)`` routes one request; ``serve(context)`` serves HTTPS in a thread."""

    def __init__(self) -> None:
        self.requests = 0  # pod lists served (an HPA reads one per sync)
        self._count = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None

    # what a source answers ------------------------------------------------------------------
    def pod_items(self, namespace: Optional[str], selector: Dict[str, str],
                  name: Optional[str] = None) -> List[Dict[str, Any]]:
        """``PodMetrics`` items (without kind/apiVersion) of ``namespace`` (None: every one) matching
        ``selector``, or the one named ``name``."""
        raise NotImplementedError

    def node_items(self, selector: Dict[str, str], name: Optional[str] = None) -> List[Dict[str, Any]]:
        return []

    # the API ------------------------------------------------------------------------------
    def answer(self, method: str, target: str) -> Tuple[int, Dict[str, Any]]:
        """(status, body) for one request: discovery, the pods' metrics (a namespace's, all, one), nodes'."""
        if method != "GET":
            return 405, status(405, f"{method} is not served")
        url = urlsplit(target)
        path = url.path.rstrip("/")
        if path in ("/openapi/v2", "/openapi/v3"):  # the aggregator merges each server's schema
            return 200, {"swagger": "2.0", "info": {"title": "tidal-metrics", "version": VERSION}, "paths": {}} \
                if path.endswith("v2") else {"paths": {}}
        if path in ("/healthz", "/readyz", "/livez"):
            return 200, {"status": "ok"}
        if path == PREFIX:
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": API_VERSION,
                         "resources": [{"name": "pods", "singularName": "", "namespaced": True, "kind": "PodMetrics",
                                        "verbs": ["get", "list"]},
                                       {"name": "nodes", "singularName": "", "namespaced": False,
                                        "kind": "NodeMetrics", "verbs": ["get", "list"]}]}
        try:
            selector = parse_selector((parse_qs(url.query).get("labelSelector") or [""])[0])
        except ValueError as exc:
            return 400, status(400, str(exc))
        parts = path[len(PREFIX):].strip("/").split("/") if path.startswith(PREFIX + "/") else []
        if parts == ["nodes"]:
            try:
                return 200, _list("NodeMetricsList", self.node_items(selector))
            except ValueError as exc:
                return 400, status(400, str(exc))
        if len(parts) == 2 and parts[0] == "nodes":
            found = self.node_items({}, parts[1])
            return (200, dict(found[0], kind="NodeMetrics", apiVersion=API_VERSION)) if found else \
                (404, status(404, f"nodemetrics {parts[1]!r} not found"))
        if parts == ["pods"] or (len(parts) == 3 and parts[0] == "namespaces" and parts[2] == "pods"):
            with self._count:
                self.requests += 1
            return 200, _list("PodMetricsList", self.pod_items(parts[1] if len(parts) == 3 else None, selector))
        if len(parts) == 4 and parts[0] == "namespaces" and parts[2] == "pods":
            found = self.pod_items(parts[1], {}, parts[3])
            return (200, dict(found[0], kind="PodMetrics", apiVersion=API_VERSION)) if found else \
                (404, status(404, f"podmetrics {parts[3]!r} not found"))
        return 404, status(404, f"{url.path} is not served here")

    def serve(self, context: ssl.SSLContext, host: str = "127.0.0.1", port: int = 0,
              authorize: Optional[Callable[[Optional[Dict[str, Any]]], Optional[str]]] = None,
              io_timeout: float = IO_TIMEOUT, max_inflight: int = MAX_INFLIGHT) -> int:
        """Serves HTTPS on ``host``:``port`` (0: a free one; returned), in a thread. ``authorize``: given the
        caller's certificate (``getpeercert()``), why it is refused (a 401), or None. A caller silent for
        ``io_timeout`` is dropped; past ``max_inflight`` requests at once, a 503."""
        api = self
        inflight = threading.BoundedSemaphore(max_inflight)

        class Handler(BaseHTTPRequestHandler):
            timeout = io_timeout  # the request must keep coming: a silent caller holds its thread this long

            def setup(self) -> None:
                self.request.settimeout(io_timeout)
                self.request.do_handshake()  # here, not in the accepting thread: a slow caller holds only itself
                super().setup()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if not inflight.acquire(timeout=1.0):
                    self.close_connection = True
                    return self._send(503, status(503, f"more than {max_inflight} requests at once; try again"))
                try:
                    why = authorize(self.connection.getpeercert()) if authorize is not None else None
                    if why is not None and self.path.rstrip("/") not in ("/healthz", "/readyz", "/livez"):
                        return self._send(401, status(401, why))
                    self._send(*api.answer("GET", self.path))
                finally:
                    inflight.release()

            def _refuse(self) -> None:
                self.close_connection = True
                self._send(405, status(405, f"{self.command} is not served"))

            do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _refuse

            def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
                """The server's own errors (a bad request line, headers too long) as a Status, never HTML."""
                self.close_connection = True
                try:
                    self._send(code, status(code, message or self.responses.get(code, ("error",))[0]))
                except OSError:
                    pass

            def _send(self, code: int, body: Dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = _Server((host, port), Handler)
        # the handshake in the request's thread (setup), not the accepting one
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True, do_handshake_on_connect=False)
        threading.Thread(target=self._server.serve_forever, name="metrics-api", daemon=True).start()
        return self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

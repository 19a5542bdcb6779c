"""The extender's HTTP server: the verbs kube-scheduler calls, their limits (body size, JSON values,
requests decoded at once, time to arrive), TLS with client certificates, and the binding."""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple

from kube import timeouts
from cluster.extender.cache import TopologyCache, pod_spec

log = logging.getLogger("tidal.extender")
MAX_BODY = 32 << 20  # 5,000 node names are ~100 KB; whole Node objects (not nodeCacheCapable) a few MB
MAX_INFLIGHT = 2  # bodies read and decoded at once; more wait up to INFLIGHT_WAIT s, then get 503
INFLIGHT_WAIT = 2.0
IO_TIMEOUT = 10.0


def _binder(api_client):
    from kubernetes import client

    core = client.CoreV1Api(api_client)

    def bind(namespace: str, name: str, uid: str, node: str) -> None:
        body = client.V1Binding(metadata=client.V1ObjectMeta(name=name, uid=uid),
                                target=client.V1ObjectReference(kind="Node", name=node, api_version="v1"))
        # the generated client cannot parse the empty Status the API answers: take it raw
        core.create_namespaced_binding(namespace, body, _preload_content=False, _request_timeout=timeouts.CALL)

    def pod(namespace: str, name: str) -> Dict[str, Any]:
        return api_client.sanitize_for_serialization(core.read_namespaced_pod(name, namespace,
                                                                           _request_timeout=timeouts.CALL))

    return bind, pod


def serve(cache: TopologyCache, port: int, host: str = "127.0.0.1", api_client=None,
          record_dir: Optional[str] = None, handler_times: Optional[List[Tuple[str, float]]] = None,
          binding: Optional[Tuple[Callable[[str, str, str, str], None], Callable[[str, str], Dict[str, Any]]]] = None,
          tls: Optional["ssl.SSLContext"] = None, bind_needs_certificate: bool = False) -> ThreadingHTTPServer:
    """``bind_needs_certificate``: /bind only from a caller with a verified client certificate (the extender
    listens beyond loopback); filter and prioritize change nothing and answer anyone who reaches them.
    ``binding``: (bind(namespace, name, uid, node), read_pod(namespace, name)) in place of the API's
    (benchmarks bind without an API server); ``handler_times``: collects (path, ms inside) per call;
    ``tls``: serve HTTPS with this server context (``tls_context``: client certificates required
    when it was given a CA), the handshake done on the connection's own thread."""
    bind, read_pod = binding or (_binder(api_client) if api_client is not None else (None, None))
    inflight = threading.BoundedSemaphore(MAX_INFLIGHT)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True
        timeout = IO_TIMEOUT  # headers and body must keep coming; a silent client is dropped

        def setup(self) -> None:
            if tls is not None:
                self.request.settimeout(IO_TIMEOUT)
                self.request.do_handshake()  # here, not in the accept loop: a slow client holds only itself
            super().setup()

        def _refuse(self) -> None:
            self.close_connection = True
            self._send(405, {"Error": f"method {self.command} is not allowed (POST)"})

        do_GET = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _refuse

        def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
            """The server's own errors (bad request line, headers too long) as JSON, never HTML."""
            self.close_connection = True
            try:
                self._send(code, {"Error": message or self.responses.get(code, ("error",))[0]})
            except OSError:
                pass

        def log_message(self, *args) -> None:  # quiet: the scheduler calls several times per pod
            pass

        def _send(self, code: int, body: Any) -> None:
            """Status line, headers and body in one write (one syscall, nothing for Nagle to hold)."""
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            timing = ""
            if getattr(self, "_started", None) is not None:  # time spent in the extender, for operators
                spent = (time.perf_counter() - self._started) * 1000
                timing = f"X-Tidal-Handler-Ms: {spent:.3f}\r\n"
                if handler_times is not None:
                    handler_times.append((self.path, spent))
            head = (f"HTTP/1.1 {code} {self.responses.get(code, ('',))[0]}\r\nContent-Type: application/json\r\n"
                    f"{timing}Content-Length: {len(data)}\r\n\r\n")
            self.wfile.write(head.encode() + data)

        def do_POST(self) -> None:
            if not inflight.acquire(timeout=INFLIGHT_WAIT):
                self.close_connection = True
                return self._send(503, {"Error": f"more than {MAX_INFLIGHT} requests at once; try again"})
            try:
                return self._post()
            finally:
                inflight.release()

        def _post(self) -> None:
            self._started = time.perf_counter()
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._send(400, {"Error": "malformed request: bad Content-Length"})
            if not 0 <= length <= MAX_BODY:
                self.close_connection = True
                return self._send(413, {"Error": f"request body of {length} bytes; at most {MAX_BODY}"})
            try:
                raw = self.rfile.read(length) or b"{}"
            except TimeoutError:
                self.close_connection = True
                return self._send(408, {"Error": f"the body did not arrive within {IO_TIMEOUT:g} s"})
            try:
                args, names = cache.read_args(raw)
                if not isinstance(args.get("Pod") or {}, dict):
                    raise ValueError("Pod must be an object")
            except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nesting too deep
                return self._send(400, {"Error": f"malformed request: {str(exc)[:200]}"})
            if record_dir:  # keep the scheduler's bodies (test fixtures are recorded this way)
                import os

                verb = self.path.rstrip("/").rsplit("/", 1)[-1]
                with open(os.path.join(record_dir, f"{verb}-{time.time_ns()}.json"), "wb") as handle:
                    handle.write(raw)
            try:
                if self.path.rstrip("/").endswith("/filter"):
                    self._send(200, cache.filter_json(args.get("Pod") or {}, names))
                    try:  # while the scheduler reads; the answer is out, so nothing more may be sent
                        cache.prepare_prioritize(args.get("Pod") or {})
                    except Exception:  # noqa: BLE001 - prioritize will compute it when asked
                        log.exception("extender: preparing prioritize")
                    return None
                if self.path.rstrip("/").endswith("/prioritize"):
                    return self._send(200, cache.prioritize_json(args.get("Pod") or {}, names))
                if self.path.rstrip("/").endswith("/bind"):
                    if bind_needs_certificate and not (tls is not None and self.request.getpeercert()):
                        return self._send(403, {"Error": "bind needs a client certificate (kube-scheduler's "
                                                         "extender tlsConfig) off loopback"})
                    if bind is None:
                        return self._send(200, {"Error": "this extender was started without API access"})
                    namespace, name, node = args.get("PodNamespace"), args.get("PodName"), args.get("Node")
                    bind(namespace, name, args.get("PodUID"), node)
                    spec = pod_spec(read_pod(namespace, name))
                    if spec is not None:
                        cache.reserve(node, spec, args.get("PodUID") or "")
                    return self._send(200, {"Error": ""})
                return self._send(404, {"Error": f"unknown verb {self.path}"})
            except Exception as exc:  # noqa: BLE001 - answer the scheduler rather than hang it
                log.exception("extender %s", self.path)
                return self._send(200, {"Error": str(exc)})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, name="extender-http", daemon=True).start()
    return server


def tls_context(cert: str, key: str, client_ca: Optional[str]) -> "ssl.SSLContext":
    """The extender's HTTPS: its certificate, and with ``client_ca`` a client certificate signed by
    that CA required of every caller (kube-scheduler's extender ``tlsConfig.certFile/keyFile``)."""
    import ssl

    from contracts.errors import TidalError

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
        if client_ca:
            context.load_verify_locations(client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise TidalError(f"extender TLS: {exc}") from None
    return context

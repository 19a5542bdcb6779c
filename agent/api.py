"""The agent's local HTTP API, on a unix socket (mode 0600) and optionally loopback TCP.

| method | path                          | body                | answers                          |
|--------|-------------------------------|---------------------|----------------------------------|
| GET    | /v1/health                    |                     | 200 {"ok": true}                 |
| GET    | /v1/workloads                 |                     | 200 {"workloads": [...]}         |
| POST   | /v1/workloads                 | a request document  | 201 {"workload": {...}}          |
| DELETE | /v1/workloads/<name>          |                     | 200 {"released": name}           |
| POST   | /v1/workloads/<name>/attach   | {"pid": N}          | 200 {"workload": {...}}          |
| GET    | /v1/status                    |                     | 200 pools, per-cpu map, counters |

Errors are JSON ``{"error": "<one line>"}`` with 400 (malformed or invalid
request), 404 (no such workload or path), 409 (name in use), 422 (does not
fit now), 500 (the kernel refused a write; nothing is left half-applied).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Optional, Tuple
from urllib.parse import urlsplit

from agent.errors import AdmissionError, TidalError

log = logging.getLogger("tidal.api")
MAX_BODY = 1 << 20


class _Handler(BaseHTTPRequestHandler):
    server_version = "tidal"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("api: " + fmt, *args)

    def address_string(self) -> str:  # unix sockets have no peer address
        return "local"

    def _send(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode() + b"\n"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> Any:
        length = self.headers.get("Content-Length")
        try:
            size = int(length) if length is not None else 0
        except ValueError:
            raise AdmissionError("bad Content-Length") from None
        if size < 0 or size > MAX_BODY:
            raise AdmissionError(f"body must be 0..{MAX_BODY} bytes")
        raw = self.rfile.read(size) if size else b""
        try:
            return json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise AdmissionError(f"malformed JSON body: {exc}") from None

    def _dispatch(self, method: str) -> None:
        from agent.daemon import Conflict, NotFound, Unfit

        agent = self.server.agent
        parts = [p for p in urlsplit(self.path).path.split("/") if p]
        try:
            if parts[:1] != ["v1"]:
                raise NotFound(f"no such path {self.path!r}")
            route = parts[1:]
            if method == "GET" and route == ["health"]:
                return self._send(200, {"ok": True})
            if method == "GET" and route == ["status"]:
                return self._send(200, agent.status())
            if method == "GET" and route == ["workloads"]:
                return self._send(200, {"workloads": agent.workloads()})
            if method == "POST" and route == ["workloads"]:
                return self._send(201, {"workload": agent.admit(self._body())})
            if method == "DELETE" and len(route) == 2 and route[0] == "workloads":
                agent.release(route[1])
                return self._send(200, {"released": route[1]})
            if method == "POST" and len(route) == 3 and route[0] == "workloads" and route[2] == "attach":
                body = self._body()
                if not isinstance(body, dict):
                    raise AdmissionError('body must be {"pid": N}')
                return self._send(200, {"workload": agent.attach(route[1], body.get("pid"))})
            raise NotFound(f"no such path {method} {self.path}")
        except AdmissionError as exc:
            self._send(400, {"error": str(exc)})
        except NotFound as exc:
            self._send(404, {"error": str(exc)})
        except Conflict as exc:
            self._send(409, {"error": str(exc)})
        except Unfit as exc:
            self._send(422, {"error": str(exc)})
        except TidalError as exc:
            self._send(500, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - the API must answer, and the agent keep serving
            log.exception("api: internal error")
            self._send(500, {"error": f"internal error: {exc}"})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self) -> Tuple[socket.socket, Tuple[str, int]]:
        conn, _ = super().get_request()
        return conn, ("local", 0)


class _TcpServer(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True


class Servers:
    def __init__(self, servers, path: Optional[str]) -> None:
        self.servers = servers
        self.path = path

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _prepare_socket_path(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale socket of a dead agent
        else:
            raise TidalError(f"{path}: another agent is already serving here")
        finally:
            probe.close()


def serve_agent(agent, socket_path: str, tcp_port: Optional[int] = None) -> Servers:
    _prepare_socket_path(socket_path)
    old_umask = os.umask(0o177)
    try:
        unix = _UnixServer(socket_path, _Handler)
    finally:
        os.umask(old_umask)
    os.chmod(socket_path, 0o600)
    unix.agent = agent
    servers = [unix]
    if tcp_port is not None:
        tcp = _TcpServer(("127.0.0.1", tcp_port), _Handler)
        tcp.agent = agent
        servers.append(tcp)
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="tidal-api",
                         daemon=True).start()
    return Servers(servers, socket_path)

"""The agent's local HTTP API, on a unix socket (mode 0600) and optionally loopback TCP.

| method | path                          | body                | answers                          |
|--------|-------------------------------|---------------------|----------------------------------|
| GET    | /v1/health                    |                     | 200 {"ok": true}                 |
| GET    | /v1/workloads                 |                     | 200 {"workloads": [...]}         |
| GET    | /v1/assignments               |                     | 200 {"assignments": {name: {qos, cpus, mems, cpu_shares, cpu_idle}}}, from memory (no kernel read) |
| POST   | /v1/workloads                 | a request document  | 201 {"workload": {...}}          |
| DELETE | /v1/workloads/<name>          |                     | 200 {"released": name}           |
| POST   | /v1/workloads/<name>/attach   | {"pid": N}          | 200 {"workload": {...}}          |
| GET    | /v1/status                    |                     | 200 pools, per-cpu map, counters |
| GET    | /v1/capacity[?format=yarn|mesos|mesos-array][&wait_generation=N&timeout=S] | | 200 reclaimed capacity (long-poll) |
| GET    | /v1/node                      |                     | 200 node state (lending)         |
| POST   | /v1/node/lend, /v1/node/reclaim | {"notice": "60s"} | 200; 409 wrong state             |
| GET    | /v1/evictions                 |                     | 200 recent evictions, by tier and cause |
| GET    | /v1/net                       |                     | 200 traffic classes per NIC      |

Errors are JSON ``{"error": "<one line>"}`` with 400 (malformed or invalid
request), 403 (the caller may not: see ``agent.authority``), 404 (no such
workload or path), 405 (method not allowed), 409 (name in use), 422 (does
not fit now), 503 (too many connections), 500 (the kernel refused a write;
nothing is left half-applied).

Bounded: at most ``MAX_CONNECTIONS`` connections per listener (more are
answered 503 and closed at once), ``IDLE_TIMEOUT`` seconds to send a
request's headers and body (a silent or half-open connection is closed),
bodies up to ``MAX_BODY``, a listen backlog of ``BACKLOG``. A slow client
holds one thread of its own, never the agent's loop or another client.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import struct
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Dict, List, Optional, Protocol, Tuple
from urllib.parse import unquote, urlsplit

from agent.authority import Caller, check, may_touch, pid_owner, token_matches
from agent.errors import AdmissionError, Conflict, Forbidden, NotFound, TidalError, Unfit
from contracts.capacity import FORMATS, render_capacity

log = logging.getLogger("tidal.api")
MAX_BODY = 1 << 20
MAX_CONNECTIONS = 256
IDLE_TIMEOUT = 10.0
BACKLOG = 512
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class AgentFace(Protocol):
    """What the API serves: the agent's face (``agent.daemon.Agent``), or any object with it.
    The API imports no agent code beyond errors and authority: it serves this protocol."""

    evictions: List[Dict[str, Any]]
    evictions_by_tier: Dict[str, int]
    evictions_by_cause: Dict[str, int]

    def status(self) -> Dict[str, Any]: ...
    def capacity_doc(self) -> Dict[str, Any]: ...
    def wait_capacity(self, generation: int, timeout: float) -> Dict[str, Any]: ...
    def node_doc(self) -> Dict[str, Any]: ...
    def lend(self, notice: Any) -> Dict[str, Any]: ...
    def take_back(self, notice: Any) -> Dict[str, Any]: ...
    def net_status(self) -> Dict[str, Any]: ...
    def workloads(self) -> List[Dict[str, Any]]: ...
    def assignments(self) -> Dict[str, Any]: ...
    def runtime_seen(self, nri_state: str) -> None: ...
    def admit(self, doc: Any, source: str = ..., owner: Optional[int] = ...) -> Dict[str, Any]: ...
    def release(self, name: str) -> None: ...
    def attach(self, name: str, pid: Any) -> Dict[str, Any]: ...
    def owner_of(self, name: str) -> Optional[int]: ...


class _SlowClient(Exception):
    """A request that did not arrive whole within the idle timeout (answered 408, then closed)."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "tidal"
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT  # per socket read: headers and body must keep coming

    def _caller(self) -> Caller:
        if isinstance(self.server, _UnixServer):
            raw = self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            return Caller("unix", uid=_PEERCRED.unpack(raw)[1])
        return Caller("tcp", token_ok=token_matches(self.headers.get("Authorization"), self.server.token))

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

    def _read_body(self) -> bytes:
        """The whole body, read before anything is answered (an answer sent over unread data is
        lost to a connection reset), bounded by ``MAX_BODY`` and the idle timeout."""
        length = self.headers.get("Content-Length")
        try:
            size = int(length) if length is not None else 0
        except ValueError:
            self.close_connection = True
            raise AdmissionError("bad Content-Length") from None
        if size < 0 or size > MAX_BODY:
            self.close_connection = True
            raise AdmissionError(f"body must be 0..{MAX_BODY} bytes")
        try:
            raw = self.rfile.read(size) if size else b""
        except TimeoutError:
            raise _SlowClient(f"the body did not arrive within {IDLE_TIMEOUT:g} s") from None
        if len(raw) < size:
            raise _SlowClient("the connection closed before the whole body arrived")
        return raw

    def _body(self) -> Any:
        raw = self._raw
        try:
            return json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as exc:  # ValueError: also integers of over 4,300 digits
            raise AdmissionError(f"malformed JSON body: {str(exc)[:200]}") from None
        except RecursionError:
            raise AdmissionError("malformed JSON body: nested too deeply") from None

    def _dispatch(self, method: str) -> None:
        agent = self.server.agent
        self._raw = b""
        parts = [unquote(p) for p in urlsplit(self.path).path.split("/") if p]
        try:
            self._raw = self._read_body()
            if parts[:1] != ["v1"] and parts != ["metrics"]:
                raise NotFound(f"no such path {self.path!r}")
            route = parts[1:]
            caller = self._caller()
            check(caller, method, route if parts[:1] == ["v1"] else parts)
            if method == "GET" and parts == ["metrics"]:
                from agent.reporter.metrics import CONTENT_TYPE, render

                body = render(agent)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return None
            if method == "GET" and route == ["health"]:
                return self._send(200, {"ok": True})
            if method == "GET" and route == ["status"]:
                return self._send(200, agent.status())
            if method == "GET" and route == ["capacity"]:
                return self._send(200, _capacity(agent, self.path))
            if method == "GET" and route == ["node"]:
                return self._send(200, agent.node_doc())
            if method == "POST" and route == ["node", "lend"]:
                return self._send(200, agent.lend(_notice(self._body())))
            if method == "POST" and route == ["node", "reclaim"]:
                return self._send(200, agent.take_back(_notice(self._body())))
            if method == "GET" and route == ["evictions"]:
                return self._send(200, {"evictions": agent.evictions, "by_tier": agent.evictions_by_tier,
                                        "by_cause": agent.evictions_by_cause})
            if method == "GET" and route == ["net"]:
                return self._send(200, agent.net_status())
            if method == "GET" and route == ["assignments"]:
                # the NRI plugin says it is registered with the runtime on every refresh (X-Tidal-NRI:
                # registered | connecting): `tidal status` tells which road confines pods from it
                nri = self.headers.get("X-Tidal-NRI")
                if nri in ("registered", "connecting"):
                    agent.runtime_seen(nri)
                return self._send(200, agent.assignments())
            if method == "GET" and route == ["workloads"]:
                return self._send(200, {"workloads": agent.workloads()})
            if method == "POST" and route == ["workloads"]:
                owner = None if caller.is_root else caller.uid
                return self._send(201, {"workload": agent.admit(self._body(), owner=owner)})
            if method == "DELETE" and len(route) == 2 and route[0] == "workloads":
                _own(agent, caller, route[1])
                agent.release(route[1])
                return self._send(200, {"released": route[1]})
            if method == "POST" and len(route) == 3 and route[0] == "workloads" and route[2] == "attach":
                body = self._body()
                if not isinstance(body, dict):
                    raise AdmissionError('body must be {"pid": N}')
                _own(agent, caller, route[1])
                pid = body.get("pid")
                if not caller.is_root and isinstance(pid, int) and pid_owner(pid) != caller.uid:
                    raise Forbidden(f"{caller.describe()} may attach only its own processes; pid {pid} is not")
                return self._send(200, {"workload": agent.attach(route[1], pid)})
            raise NotFound(f"no such path {method} {self.path}")
        except _SlowClient as exc:
            self.close_connection = True
            try:
                self._send(408, {"error": str(exc)})
            except OSError:
                pass
        except AdmissionError as exc:
            self._send(400, {"error": str(exc)})
        except Forbidden as exc:
            self._send(403, {"error": str(exc)})
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

    def _drain(self) -> None:
        """Read what the client is still sending (bounded) before answering and closing: closing a
        socket with unread data resets the connection, and the client would lose the answer."""
        self.close_connection = True
        try:
            length = int(self.headers.get("Content-Length") or 0) if getattr(self, "headers", None) else 0
        except ValueError:
            length = 0
        try:
            if 0 < length <= MAX_BODY:
                self.connection.settimeout(0.2)
                self.rfile.read(length)
            else:  # what has arrived already (the rest of an over-long header), without waiting
                self.connection.setblocking(False)
                while self.connection.recv(1 << 20):
                    pass
        except OSError:
            pass
        finally:
            self.connection.settimeout(IDLE_TIMEOUT)

    def _not_allowed(self) -> None:
        self._drain()
        self._send(405, {"error": f"method {self.command} is not allowed (GET, POST, DELETE)"})

    do_PUT = do_PATCH = do_HEAD = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """The server's own errors (a malformed request line, headers too long, an unknown
        method) as one JSON line like every other answer, never HTML; an unknown method is a 405."""
        if code == 501:
            code, message = 405, f"method {self.command} is not allowed (GET, POST, DELETE)"
        self._drain()
        try:
            self._send(code, {"error": message or self.responses.get(code, ("error",))[0]})
        except OSError:
            pass


def _own(agent, caller: Caller, name: str) -> None:
    """Non-root callers may release or attach to their own workloads only."""
    owner = agent.owner_of(name)  # NotFound when there is no such workload
    if not may_touch(caller, owner):
        raise Forbidden(f"{caller.describe()} may not change workload {name!r}: it is not its own")


MAX_WAIT_S = 300.0


def _notice(body: Any) -> Any:
    if body is None:
        return 60
    if not isinstance(body, dict):
        raise AdmissionError('body must be {"notice": "60s"}')
    unknown = set(body) - {"notice"}
    if unknown:
        raise AdmissionError(f"unknown field(s) {', '.join(sorted(unknown))}")
    return body.get("notice", 60)


def _capacity(agent, raw_path: str) -> Any:
    """GET /v1/capacity[?format=yarn|mesos|mesos-array][&wait_generation=N&timeout=S]
    [&revocable_cpus=X&revocable_mem_mb=Y] (Mesos: what revocable tasks hold, subtracted)."""
    from urllib.parse import parse_qs

    query = urlsplit(raw_path).query
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise AdmissionError(f"malformed query string {query!r}") from None
    unknown = set(params) - {"format", "wait_generation", "timeout", "revocable_cpus", "revocable_mem_mb"}
    if unknown:
        raise AdmissionError(f"unknown query parameter(s) {', '.join(sorted(unknown))}")
    if any(len(v) != 1 for v in params.values()):
        raise AdmissionError("each query parameter may be given once")
    fmt = params.get("format", ["tidal"])[0]
    if fmt not in FORMATS:
        raise AdmissionError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    in_use = None
    if "revocable_cpus" in params or "revocable_mem_mb" in params:
        if not fmt.startswith("mesos"):
            raise AdmissionError("revocable_cpus and revocable_mem_mb go with format=mesos or mesos-array")
        try:
            in_use = (float(params.get("revocable_cpus", ["0"])[0]), float(params.get("revocable_mem_mb", ["0"])[0]))
        except ValueError:
            raise AdmissionError("revocable_cpus and revocable_mem_mb must be numbers") from None
        if not all(0 <= v < 1e12 for v in in_use):  # also refuses nan and inf
            raise AdmissionError("revocable_cpus and revocable_mem_mb must be >= 0 and finite")
    if "wait_generation" in params:
        try:
            generation = int(params["wait_generation"][0])
            timeout = float(params.get("timeout", ["30"])[0])
        except ValueError:
            raise AdmissionError("wait_generation must be an integer and timeout a number of seconds") from None
        if generation < 0 or not (0 <= timeout <= MAX_WAIT_S):
            raise AdmissionError(f"wait_generation must be >= 0 and timeout within 0..{MAX_WAIT_S:g} s")
        doc = agent.wait_capacity(generation, timeout)
    elif "timeout" in params:
        raise AdmissionError("timeout goes with wait_generation")
    else:
        doc = agent.capacity_doc()
    return render_capacity(doc, fmt, revocable_in_use=in_use)


_BUSY_BODY = b'{"error": "too many connections; try again"}\n'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class _Bounded(socketserver.ThreadingMixIn):
    """At most ``MAX_CONNECTIONS`` at once: the next is answered 503 and closed, so a flood of
    idle connections costs neither file descriptors nor threads beyond the cap."""

    daemon_threads = True
    request_queue_size = BACKLOG
    token: Optional[str] = None

    def server_activate(self) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().server_activate()

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _UnixServer(_Bounded, socketserver.UnixStreamServer):
    def get_request(self) -> Tuple[socket.socket, Tuple[str, int]]:
        conn, _ = super().get_request()
        return conn, ("local", 0)


class _TcpServer(_Bounded, HTTPServer):
    pass


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
    import stat as _stat

    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    except OSError as exc:
        raise TidalError(f"--socket {path}: cannot make its directory: {exc.strerror}") from None
    if os.path.lexists(path) and not _stat.S_ISSOCK(os.lstat(path).st_mode):
        raise TidalError(f"--socket {path}: exists and is not a socket; refusing to replace it")
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


def serve_agent(agent: AgentFace, socket_path: str, tcp_port: Optional[int] = None, poll_interval: float = 0.5,
                socket_group: Optional[int] = None, tcp_token: Optional[str] = None) -> Servers:
    """Serve in daemon threads. ``poll_interval`` is how often an idle server wakes
    to check for shutdown: each wake costs cpu, so the agent keeps it long.
    ``socket_group``: a gid whose members may use the socket (mode 0660) with a user's
    authority; ``tcp_token``: the bearer token that gives TCP clients root's (see authority)."""
    _prepare_socket_path(socket_path)
    old_umask = os.umask(0o177)
    try:
        unix = _UnixServer(socket_path, _Handler)
    except OSError as exc:
        raise TidalError(f"--socket {socket_path}: cannot listen: {exc.strerror or exc}") from None
    finally:
        os.umask(old_umask)
    if socket_group is not None:
        os.chown(socket_path, 0, socket_group)
    os.chmod(socket_path, 0o660 if socket_group is not None else 0o600)
    unix.agent = agent
    servers = [unix]
    if tcp_port is not None:
        tcp = _TcpServer(("127.0.0.1", tcp_port), _Handler)
        tcp.agent = agent
        tcp.token = tcp_token
        servers.append(tcp)
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": poll_interval}, name="tidal-api",
                         daemon=True).start()
    return Servers(servers, socket_path)

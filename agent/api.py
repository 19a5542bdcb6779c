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
| POST   | /v1/offline/attach            | {"cgroup", "pid"}   | 200: pid in a declared offline cgroup (root) |
| GET    | /v1/evictions                 |                     | 200 recent evictions, by tier and cause |
| GET    | /v1/net                       |                     | 200 traffic classes per NIC      |
| GET    | /openapi.json                 |                     | 200 this API's OpenAPI document  |

Errors are JSON ``{"error": "<one line>"}`` with 400 (malformed or invalid
request), 403 (the caller may not: see ``agent.authority``), 404 (no such
workload or path), 405 (method not allowed), 408 (the request did not arrive
in time), 409 (name in use), 413 (body too large), 422 (does not fit now),
503 (too many connections), 500 (the kernel refused a write; nothing is left
half-applied).

Bounded (``agent.connections``): each listener has ``MAX_CONNECTIONS`` slots,
at most ``MAX_PER_PEER`` for one unprivileged peer (a uid, by the kernel's
word) and the last ``RESERVED`` for root and the NRI plugin; a request's line,
headers and body must arrive within ``REQUEST_DEADLINE`` of its first byte, an
idle connection is closed after ``IDLE_TIMEOUT``; long-polls wait in a pool
of their own; bodies up to ``MAX_BODY``, JSON nested at most ``MAX_DEPTH``
deep. A connection over a limit is answered 503 and closed at once. A slow
client holds one thread of its own, never the agent's loop or another client.

The API is described by an OpenAPI document (``GET /openapi.json``,
``agent/openapi.json``): the source of the API reference and of the fuzz
tests that check the agent against it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Dict, List, Optional, Protocol, Tuple
from urllib.parse import unquote, urlsplit

from agent import connections
from agent.authority import Caller, check, may_touch, pid_owner, token_matches
from agent.connections import IDLE_TIMEOUT, MAX_CONNECTIONS, REQUEST_DEADLINE, DeadlineReader, Peer, Slots
from agent.errors import AdmissionError, Conflict, Forbidden, NotFound, TidalError, Unfit
from agent.workers import Workers
from contracts.capacity import FORMATS, render_capacity
from contracts.jsonbound import BoundError, loads_bounded

log = logging.getLogger("tidal.api")
MAX_BODY = 1 << 20
BACKLOG = 512
ACCEPT_BATCH = 64  # connections one wake of a listener's accept loop takes, at most
OPENAPI = os.path.join(os.path.dirname(__file__), "openapi.json")


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
    def join_offline(self, cgroup: Any, pid: Any) -> Dict[str, Any]: ...
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
    """A request that did not arrive whole within its deadline (answered 408, then closed)."""


class _TooLarge(Exception):
    """A body over ``MAX_BODY`` (answered 413, then closed)."""


class _Handler(BaseHTTPRequestHandler):
    server_version = "tidal"
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT

    def setup(self) -> None:
        super().setup()
        # every read of this connection under the request deadline (agent.connections)
        self.reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)
        self.peer: Peer = self.server.peers.get(self.connection) or Peer("unknown", uid=None, address="?")

    def handle_one_request(self) -> None:
        self.reader.start_request()
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: not the agent's error

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.reader.eof:  # the headers ended at the end of the stream, not at their blank line
            self.send_error(400, "the request ended before its headers did; nothing was done")
            self.close_connection = True
            return False
        return True

    def _caller(self) -> Caller:
        if self.server.via == "tcp":
            return Caller("tcp", uid=self.peer.uid,
                          token_ok=token_matches(self.headers.get("Authorization"), self.server.token))
        return Caller(self.server.via, uid=self.peer.uid)

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("api: " + fmt, *args)

    def address_string(self) -> str:  # unix sockets have no peer address
        return "local"

    def _send(self, status: int, payload: Any) -> None:
        self._send_raw(status, json.dumps(payload).encode() + b"\n")

    def _send_raw(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _waiting(self, wait):
        """Run a long-poll ``wait()`` holding a waiter's slot instead of a request slot (so waits never
        stop requests); the request slot is taken back after, or the connection closes."""
        server, key = self.server, self.peer.key
        privileged = server.privileged(self.peer)
        if not server.waiters.take(key, privileged):
            raise _Busy("too many long-polls; try again")
        server.slots.give(key)
        server.holding[self.connection] = False
        try:
            return wait()
        finally:
            server.waiters.give(key)
            if server.slots.take(key, privileged):
                server.holding[self.connection] = True
            else:  # answer this one, then let the connection go: requests have no slot for it now
                self.close_connection = True

    def _read_body(self) -> bytes:
        """The whole body, read before anything is answered (an answer sent over unread data is
        lost to a connection reset), bounded by ``MAX_BODY`` and the idle timeout."""
        length = self.headers.get("Content-Length")
        try:
            size = int(length) if length is not None else 0
        except ValueError:
            self.close_connection = True
            raise AdmissionError("bad Content-Length") from None
        if size < 0:
            self.close_connection = True
            raise AdmissionError("bad Content-Length")
        if size > MAX_BODY:
            self.close_connection = True
            raise _TooLarge(f"body of {size} bytes; at most {MAX_BODY}")
        try:
            raw = self.rfile.read(size) if size else b""
        except TimeoutError:
            raise _SlowClient(f"the request did not arrive within {REQUEST_DEADLINE:g} s of its first byte") from None
        if len(raw) < size:
            raise _SlowClient("the connection closed before the whole body arrived")
        return raw

    def _body(self) -> Any:
        try:
            return loads_bounded(self._raw or b"null")
        except BoundError as exc:
            raise AdmissionError(f"malformed JSON body: {exc}") from None

    def _dispatch(self, method: str) -> None:
        agent = self.server.agent
        self._raw = b""
        parts = [unquote(p) for p in urlsplit(self.path).path.split("/") if p]
        try:
            self._raw = self._read_body()
            if parts[:1] != ["v1"] and parts not in (["metrics"], ["openapi.json"]):
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
            if method == "GET" and parts == ["openapi.json"]:
                with open(OPENAPI, "rb") as handle:
                    return self._send_raw(200, handle.read())
            if method == "GET" and route == ["status"]:
                return self._send(200, agent.status())
            if method == "GET" and route == ["capacity"]:
                return self._send(200, _capacity(agent, self.path, self._waiting))
            if method == "GET" and route == ["node"]:
                return self._send(200, agent.node_doc())
            if method == "POST" and route == ["node", "lend"]:
                return self._send(200, agent.lend(_notice(self._body())))
            if method == "POST" and route == ["node", "reclaim"]:
                return self._send(200, agent.take_back(_notice(self._body())))
            if method == "POST" and route == ["offline", "attach"]:
                body = self._body()
                if not isinstance(body, dict) or set(body) - {"cgroup", "pid"}:
                    raise AdmissionError('body must be {"cgroup": "/hadoop-yarn", "pid": N}')
                return self._send(200, agent.join_offline(body.get("cgroup"), body.get("pid")))
            if method == "GET" and route == ["evictions"]:
                return self._send(200, {"evictions": agent.eviction.evictions, "by_tier": agent.eviction.by_tier,
                                        "by_cause": agent.eviction.by_cause})
            if method == "GET" and route == ["net"]:
                return self._send(200, agent.net_status())
            if method == "GET" and route == ["assignments"]:
                # the NRI plugin says it is registered with the runtime on every refresh (X-Tidal-NRI:
                # registered | connecting): `tidal status` tells which road confines pods from it
                nri = self.headers.get("X-Tidal-NRI")
                if nri in ("registered", "connecting") and caller.may_report_runtime:
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
        except _TooLarge as exc:
            self._drain()
            self._send(413, {"error": str(exc)})
        except _Busy as exc:
            self.close_connection = True
            self._send(503, {"error": str(exc)})
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
        except (BrokenPipeError, ConnectionResetError):
            raise  # the client went away mid-answer: nothing to answer (handle_one_request closes it)
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


def _capacity(agent, raw_path: str, waiting=lambda wait: wait()) -> Any:
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
        doc = waiting(lambda: agent.wait_capacity(generation, timeout))
    elif "timeout" in params:
        raise AdmissionError("timeout goes with wait_generation")
    else:
        doc = agent.capacity_doc()
    return render_capacity(doc, fmt, revocable_in_use=in_use)


_BUSY_BODY = b'{"error": "too many connections; try again"}\n'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class _Busy(Exception):
    """No slot for what the request asks (answered 503, then closed)."""


class _Bounded:
    """Slots per listener and per peer (``agent.connections``): a connection with no slot is
    answered 503 and closed at once, so a flood costs neither descriptors nor threads beyond the caps.
    Each connection with a slot is served on a thread of ``agent.workers`` (reused, not started per
    connection), and each wake of the accept loop takes every connection the kernel has queued (up to
    ``ACCEPT_BATCH``): under a flood of reconnections the accept loop must keep up with the queue, or
    an honest client's connection waits behind the flood's. ``via``: "unix", "plugin" or "tcp"."""

    request_queue_size = BACKLOG
    token: Optional[str] = None
    via = "unix"

    def server_activate(self) -> None:
        self.slots = Slots(MAX_CONNECTIONS, connections.MAX_PER_PEER, connections.RESERVED)
        self.waiters = Slots(connections.MAX_WAITERS, connections.MAX_WAITERS_PER_PEER, connections.RESERVED)
        self.peers: Dict[socket.socket, Peer] = {}
        self.holding: Dict[socket.socket, bool] = {}  # does the connection hold a request slot now
        self.workers = Workers(self._serve, name=f"tidal-api-{self.via}")
        super().server_activate()
        self.socket.setblocking(False)  # the accept loop takes what is queued, then waits again

    def privileged(self, peer: Peer) -> bool:
        """Root, and every peer of the plugin socket (its mode lets only the plugin's uid and root in)."""
        return peer.uid == 0 or self.via == "plugin"

    def _handle_request_noblock(self) -> None:  # socketserver's accept, called when the listener is readable
        for _ in range(ACCEPT_BATCH):
            try:
                request, client_address = self.get_request()
            except OSError:  # nothing more queued (EAGAIN), or a connection reset before it was taken
                return
            self.process_request(request, client_address)

    def process_request(self, request, client_address) -> None:
        try:
            peer = connections.peer_of(request, client_address, self.via)
        except OSError:
            self.shutdown_request(request)
            return
        if not self.slots.take(peer.key, self.privileged(peer)):
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.peers[request] = peer
        self.holding[request] = True
        try:
            self.workers.submit(request, client_address)
        except RuntimeError as exc:  # no thread could be started: refused like a connection with no slot
            log.warning("api: no thread for a %s connection: %s", self.via, exc)
            self._release(request)
            try:
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)

    def _serve(self, request, client_address) -> None:
        """One connection, on a worker thread: its requests, then it is closed and its slot given back."""
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one connection's failure is logged, the listener serves on
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._release(request)

    def _release(self, request) -> None:
        peer = self.peers.pop(request, None)
        if self.holding.pop(request, False) and peer is not None:
            self.slots.give(peer.key)


class _UnixServer(_Bounded, socketserver.UnixStreamServer):
    def get_request(self) -> Tuple[socket.socket, Tuple[str, int]]:
        conn, _ = super().get_request()
        return conn, ("local", 0)


class _TcpServer(_Bounded, HTTPServer):
    via = "tcp"


class Servers:
    def __init__(self, servers, paths) -> None:
        self.servers = servers
        self.paths = [p for p in paths if p]

    def status(self) -> Dict[str, Any]:
        """Per listener: connection slots used, peers holding them, refusals (requests and long-polls), and
        its serving threads (alive, idle, ever started)."""
        return {server.via: {"requests": server.slots.status(), "long_polls": server.waiters.status(),
                             "threads": server.workers.status()}
                for server in self.servers}

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        for path in self.paths:
            try:
                os.unlink(path)
            except OSError:
                pass


_UNIX_PATH_MAX = 108  # sockaddr_un's sun_path, its closing NUL included


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


def _listen_unix(path: str, option: str, via: str, agent, owner: Optional[int], group: Optional[int],
                 mode: int) -> "_UnixServer":
    """A server listening on ``path``, which appears only once it listens, with its group and mode: bound
    to ``.<name>`` in the same directory, then linked to ``path`` (a client that sees the file can connect;
    link(), unlike rename(), fails where another agent made ``path`` meanwhile). Where ``.<name>`` would
    be longer than a socket's address may be, ``path`` itself is bound (it then appears a moment before the
    agent listens)."""
    _prepare_socket_path(path)
    staging = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
    if len(os.fsencode(staging)) >= _UNIX_PATH_MAX:
        staging = path
    if staging != path and os.path.lexists(staging):
        os.unlink(staging)  # what an agent killed while it started left
    old_umask = os.umask(0o177)
    server = None
    try:
        server = _UnixServer(staging, _Handler, bind_and_activate=False)
        server.via = via
        server.server_bind()
        server.server_activate()
        if group is not None:
            os.chown(staging, -1, group)
        os.chmod(staging, mode)
        if staging != path:
            os.link(staging, path)  # the owner stays ours until here: linking another's file takes CAP_FOWNER
        if owner is not None and owner != os.geteuid():
            os.chown(path, owner, -1)
    except FileExistsError:
        server.server_close()
        raise TidalError(f"{path}: another agent is already serving here") from None
    except OSError as exc:
        if server is not None:
            server.server_close()
        raise TidalError(f"{option} {path}: cannot listen: {exc.strerror or exc}") from None
    finally:
        os.umask(old_umask)
        if staging != path:
            try:
                os.unlink(staging)
            except OSError:
                pass
    server.agent = agent
    return server


def serve_agent(agent: AgentFace, socket_path: str, tcp_port: Optional[int] = None, poll_interval: float = 0.5,
                socket_group: Optional[int] = None, tcp_token: Optional[str] = None,
                plugin_socket: Optional[str] = None, plugin_uid: int = 0) -> Servers:
    """Serve in daemon threads. ``poll_interval`` is how often an idle server wakes
    to check for shutdown: each wake costs cpu, so the agent keeps it long.
    ``socket_group``: a gid whose members may use the socket (mode 0660) with a user's
    authority; ``tcp_token``: the bearer token that gives TCP clients root's (see authority);
    ``plugin_socket``/``plugin_uid``: a read-only socket owned by the NRI plugin's uid (mode 0600),
    whose peers are the plugin (see authority)."""
    unix = _listen_unix(socket_path, "--socket", "unix", agent, None, socket_group,
                        0o660 if socket_group is not None else 0o600)
    servers = [unix]
    if plugin_socket is not None:
        try:
            servers.append(_listen_unix(plugin_socket, "--plugin-socket", "plugin", agent, plugin_uid, None, 0o600))
        except TidalError:
            unix.server_close()
            raise
    if tcp_port is not None:
        try:
            tcp = _TcpServer(("127.0.0.1", tcp_port), _Handler)
        except OSError as exc:
            for server in servers:
                server.server_close()
            raise TidalError(f"--tcp-port {tcp_port}: cannot listen: {exc.strerror or exc}") from None
        tcp.agent = agent
        tcp.token = tcp_token
        servers.append(tcp)
    for server in servers:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": poll_interval}, name="tidal-api",
                         daemon=True).start()
    return Servers(servers, [socket_path, plugin_socket])

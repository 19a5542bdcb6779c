"""Who is on the other end of an API connection, and how many connections each may hold.

The agent's API serves each connection on a thread of its own (``agent.workers``). Without limits one
local user holds every thread with slow requests (one header line every few
seconds) and locks out root, the token holder and the NRI plugin. So:

* **Peers.** A connection's peer is known the moment it is accepted: on a
  unix socket from ``SO_PEERCRED`` (the kernel's word, not the client's), on
  loopback TCP from the kernel's socket diagnostics (netlink sock_diag asked
  for the client's own end, which names its uid; ``/proc/net/tcp`` where
  netlink cannot be asked), else by its address.
* **Slots.** A listener has ``total`` slots. A peer that is not privileged
  holds at most ``per_peer`` of them, and never the last ``reserved``: those
  are kept for root and the registered NRI plugin, so a flood by any number
  of unprivileged peers leaves them served.
* **Long-polls** (``/v1/capacity?wait_generation=``) give their request slot
  back while they wait and hold a slot of a second, separate pool, bounded the
  same way: waiters never stop requests.
* **Deadlines.** A request's line, headers and body must all arrive within
  ``REQUEST_DEADLINE`` of its first byte (a per-read timeout let a client
  sending one byte every few seconds hold a connection for ever); an idle
  keep-alive connection is closed after ``IDLE_TIMEOUT``.
"""

from __future__ import annotations

import errno
import io
import ipaddress
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

MAX_CONNECTIONS = 256  # per listener
MAX_PER_PEER = 32  # connections one unprivileged peer (a uid, or an address) may hold on one listener
RESERVED = 16  # slots only root and the NRI plugin may take
MAX_WAITERS = 256  # long-polls per listener (a pool of their own)
MAX_WAITERS_PER_PEER = 16
IDLE_TIMEOUT = 10.0  # seconds a connection may wait between requests
REQUEST_DEADLINE = 10.0  # seconds from a request's first byte to its last (line, headers, body)
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    """The other end of one connection: ``key`` groups its connections (``uid:N`` or ``addr:IP``)."""

    via: str  # "unix", "plugin" (the NRI plugin's socket) or "tcp"
    uid: Optional[int]  # the kernel's word; None where it could not be read (TCP from another netns)
    address: Optional[str] = None

    @property
    def key(self) -> str:
        return f"uid:{self.uid}" if self.uid is not None else f"addr:{self.address}"


def unix_peer(conn: socket.socket, via: str = "unix") -> Peer:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return Peer(via, uid=_PEERCRED.unpack(raw)[1])


def _hex_endpoint(address: str, port: int) -> Tuple[str, str]:
    """An endpoint as /proc/net/tcp{,6} writes it: the address in host byte order words, the port in hex."""
    ip = ipaddress.ip_address(address)
    packed = ip.packed
    words = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))
    return words.hex().upper(), f"{port:04X}"


class _NoDiag(Exception):
    """The kernel's socket diagnostics cannot be asked here (no netlink sock_diag, no inet_diag module)."""


# netlink sock_diag (linux/sock_diag.h, linux/inet_diag.h): one request for one TCP socket by its four-tuple.
# Written with the stdlib: pyroute2, the project's netlink library, has no single-socket lookup (its
# get_sock_stats dumps every socket) and its package import takes 0.18 s here and 17 s under the v2 tier's
# emulation, in a listener's accept loop; the two fixed structs below are the whole protocol used.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_UID_AT = 4 + 48 + 12  # inet_diag_msg: family..retrans, the socket id, expires/rqueue/wqueue, then uid
_diag = threading.local()  # one netlink socket per thread that asks (a listener's accept loop)
_diag_works: Optional[bool] = None  # learned once: the kernel found a socket we hold


def _request(family: int, src: bytes, sport: int, dst: bytes, dport: int, seq: int) -> bytes:
    body = (struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFF)  # every tcp state
            + struct.pack(">HH", sport, dport) + src.ljust(16, b"\0") + dst.ljust(16, b"\0")
            + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE))
    return _NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, seq, 0) + body


def _ask(family: int, src: bytes, sport: int, dst: bytes, dport: int) -> Optional[int]:
    """The uid of the TCP socket whose own end is src:sport and other end dst:dport; None: no such socket
    (ENOENT). Other errors raise ``_NoDiag``."""
    sock = getattr(_diag, "socket", None)
    try:
        if sock is None:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
            sock.settimeout(1.0)
            _diag.socket, _diag.seq = sock, 0
        _diag.seq += 1
        sock.send(_request(family, src, sport, dst, dport, _diag.seq))
        while True:
            data = sock.recv(8192)
            at = 0
            while at + _NLMSG.size <= len(data):
                length, kind, _, seq, _ = _NLMSG.unpack_from(data, at)
                if length < _NLMSG.size:
                    raise _NoDiag("a malformed netlink answer")
                payload = data[at + _NLMSG.size:at + length]
                at += (length + 3) & ~3
                if seq != _diag.seq:
                    continue  # the answer to an earlier request that timed out
                if kind == _NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code == errno.ENOENT:
                        return None
                    raise _NoDiag(os.strerror(code))
                if kind == _SOCK_DIAG_BY_FAMILY and len(payload) >= _UID_AT + 4:
                    return struct.unpack_from("=I", payload, _UID_AT)[0]
    except OSError as exc:
        _diag.socket = None
        if sock is not None:
            sock.close()
        raise _NoDiag(str(exc)) from exc


def diag_tcp_uid(peer: Tuple[str, int], local: Tuple[str, int]) -> Optional[int]:
    """The uid owning the TCP socket whose own end is ``peer`` and whose other end is ``local``, looked up
    by the kernel in its socket hash (netlink ``SOCK_DIAG_BY_FAMILY`` for one socket, not a dump): the cost
    does not grow with the sockets the host has. None when there is no such socket; ``_NoDiag`` when the
    kernel cannot be asked (learned once, from a socket we hold: a kernel without ``inet_diag`` also answers
    ENOENT)."""
    global _diag_works
    try:
        ips = ipaddress.ip_address(peer[0]), ipaddress.ip_address(local[0])
    except ValueError:
        return None
    family = socket.AF_INET6 if ips[0].version == 6 else socket.AF_INET
    if _diag_works is None:
        _diag_works = _ask(family, ips[1].packed, local[1], ips[0].packed, peer[1]) is not None  # our own end
    if not _diag_works:
        raise _NoDiag("the kernel's socket diagnostics did not find a socket this process holds")
    return _ask(family, ips[0].packed, peer[1], ips[1].packed, local[1])


def proc_tcp_uid(peer: Tuple[str, int], local: Tuple[str, int], proc: str = "/proc") -> Optional[int]:
    """The same from the kernel's socket table as text (``/proc/net/tcp{,6}``: the row whose local end is
    the peer's and whose remote end is ours), found by one byte search, not a parse of every row."""
    try:
        family = "tcp6" if ":" in peer[0] else "tcp"
        want = " {}:{} {}:{} ".format(*_hex_endpoint(peer[0], peer[1]), *_hex_endpoint(local[0], local[1]))
    except ValueError:
        return None
    try:
        with open(f"{proc}/net/{family}", "rb") as handle:
            table = handle.read()
    except OSError:
        return None
    at = table.find(want.encode())
    if at < 0:
        return None
    end = table.find(b"\n", at)
    fields = table[at:end if end >= 0 else None].split()
    try:  # local, remote, st, tx:rx, tr:when, retrnsmt, uid
        return int(fields[6])
    except (IndexError, ValueError):
        return None


def tcp_peer_uid(peer: Tuple[str, int], local: Tuple[str, int], proc: str = "/proc") -> Optional[int]:
    """The uid owning the client end of a loopback TCP connection: the kernel's socket diagnostics, or its
    socket table where those cannot be asked. None when not found. It runs in a listener's accept loop, once
    a connection: a flood of reconnections must not make it slow for the next honest client."""
    try:
        return diag_tcp_uid(peer, local)
    except _NoDiag:
        return proc_tcp_uid(peer, local, proc)


def tcp_peer(conn: socket.socket, address: Tuple[str, int]) -> Peer:
    try:
        local = conn.getsockname()[:2]
    except OSError:
        return Peer("tcp", uid=None, address=address[0])
    return Peer("tcp", uid=tcp_peer_uid(address[:2], local), address=address[0])


class Slots:
    """Bounded connection slots of one listener (see the module docstring)."""

    def __init__(self, total: int, per_peer: int, reserved: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self.reserved = reserved
        self.used = 0
        self.by_peer: Dict[str, int] = {}
        self.refused = 0
        self._lock = threading.Lock()

    def take(self, key: str, privileged: bool) -> bool:
        with self._lock:
            held = self.by_peer.get(key, 0)
            if privileged:
                ok = self.used < self.total
            else:
                ok = held < self.per_peer and self.used < self.total - self.reserved
            if not ok:
                self.refused += 1
                return False
            self.used += 1
            self.by_peer[key] = held + 1
            return True

    def give(self, key: str) -> None:
        with self._lock:
            held = self.by_peer.get(key, 0)
            if held <= 0:
                return
            self.used -= 1
            if held == 1:
                del self.by_peer[key]
            else:
                self.by_peer[key] = held - 1

    def status(self) -> Dict[str, int]:
        with self._lock:
            return {"used": self.used, "total": self.total, "peers": len(self.by_peer), "refused": self.refused}


class DeadlineReader(io.RawIOBase):
    """A connection's reads under the two limits: ``IDLE_TIMEOUT`` before a request's first byte,
    then ``REQUEST_DEADLINE`` from that byte for the whole request. ``start_request()`` re-arms it
    (the next read waits for a new request's first byte); a read past the deadline raises
    ``TimeoutError``. ``eof``: the client's end of the stream was read during this request (a header
    block that ends there was cut short: the stdlib's parser takes it as whole)."""

    def __init__(self, conn: socket.socket, idle: float = IDLE_TIMEOUT, deadline: float = REQUEST_DEADLINE) -> None:
        super().__init__()
        self.conn = conn
        self.idle = idle
        self.deadline_s = deadline
        self.deadline: Optional[float] = None
        self.eof = False

    def readable(self) -> bool:
        return True

    def start_request(self) -> None:
        self.deadline = None
        self.eof = False

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            self.conn.settimeout(self.idle)
        else:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("request deadline passed")
            self.conn.settimeout(remaining)
        count = self.conn.recv_into(buffer)
        if not count:
            self.eof = True
        elif self.deadline is None:
            self.deadline = time.monotonic() + self.deadline_s
        return count


def peer_of(conn: socket.socket, address, via: str) -> Peer:
    """The peer of a connection just accepted on a listener of kind ``via``."""
    if via == "tcp":
        return tcp_peer(conn, address)
    return unix_peer(conn, via)

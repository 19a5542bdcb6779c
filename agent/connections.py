"""Who is on the other end of an API connection, and how many connections each may hold.

The agent's API is served by one thread per connection. Without limits one
local user holds every thread with slow requests (one header line every few
seconds) and locks out root, the token holder and the NRI plugin. So:

* **Peers.** A connection's peer is known the moment it is accepted: on a
  unix socket from ``SO_PEERCRED`` (the kernel's word, not the client's), on
  loopback TCP from the kernel's socket table (``/proc/net/tcp``: the row of
  the client's own end names its uid), else by its address.
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

import io
import ipaddress
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


def tcp_peer_uid(peer: Tuple[str, int], local: Tuple[str, int], proc: str = "/proc") -> Optional[int]:
    """The uid owning the client end of a loopback TCP connection, from the kernel's socket table: the
    row whose local end is the peer's address and whose remote end is ours. None when not found."""
    try:
        family = "tcp6" if ":" in peer[0] else "tcp"
        want_local = ":".join(_hex_endpoint(peer[0], peer[1]))
        want_remote = ":".join(_hex_endpoint(local[0], local[1]))
    except ValueError:
        return None
    try:
        with open(f"{proc}/net/{family}", "rb") as handle:
            next(handle, None)  # the header
            for line in handle:
                fields = line.split()
                if len(fields) > 7 and fields[1].decode() == want_local and fields[2].decode() == want_remote:
                    return int(fields[7])
    except (OSError, ValueError):
        return None
    return None


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
    ``TimeoutError``."""

    def __init__(self, conn: socket.socket, idle: float = IDLE_TIMEOUT, deadline: float = REQUEST_DEADLINE) -> None:
        super().__init__()
        self.conn = conn
        self.idle = idle
        self.deadline_s = deadline
        self.deadline: Optional[float] = None

    def readable(self) -> bool:
        return True

    def start_request(self) -> None:
        self.deadline = None

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            self.conn.settimeout(self.idle)
        else:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("request deadline passed")
            self.conn.settimeout(remaining)
        count = self.conn.recv_into(buffer)
        if count and self.deadline is None:
            self.deadline = time.monotonic() + self.deadline_s
        return count


def peer_of(conn: socket.socket, address, via: str) -> Peer:
    """The peer of a connection just accepted on a listener of kind ``via``."""
    if via == "tcp":
        return tcp_peer(conn, address)
    return unix_peer(conn, via)

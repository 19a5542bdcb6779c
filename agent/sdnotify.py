"""systemd's readiness and watchdog protocol (sd_notify(3)): one datagram to $NOTIFY_SOCKET.

No-ops outside systemd. The agent sends READY=1 once it serves, and
WATCHDOG=1 every loop period, so ``WatchdogSec=`` restarts an agent whose
loop hangs.
"""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_enabled() -> bool:
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    return bool(usec) and (pid is None or pid == str(os.getpid()))

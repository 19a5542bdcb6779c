"""Traffic programs for the network tests and ``tidal bench net-isolation``.

Run as ``python -m agent.bench.traffic <verb> ...`` inside a network namespace
(``nsenter --net=/run/netns/NAME``), so each side is a separate process:

* ``sink ADDR PORT``: accept TCP connections and discard what they send.
* ``send ADDR PORT SECONDS [--wait]``: send as fast as TCP allows; with
  ``--wait`` first read one line from stdin (so a test can move the process
  into a cgroup before its socket exists: a socket belongs to the cgroup of the
  task that made it). Returns once the sink has read everything; prints
  ``{"bytes", "seconds", "mbps"}``.
* ``echo ADDR PORT``: a UDP echo server.
* ``rr ADDR PORT SECONDS RATE``: UDP request/response at RATE requests/s;
  prints ``{"sent", "lost", "p50_us", "p99_us", "samples_us", "forward_us"}``
  (forward: send to the server's arrival stamp, the shaped direction).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import List


def sink(addr: str, port: int) -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((addr, port))
    server.listen(64)
    print("ready", flush=True)

    def drain(conn: socket.socket) -> None:
        # into one buffer: a fresh 256 KiB bytes per call is an mmap and 64 page faults each time,
        # cpu that the sink (another machine, in the benchmark's picture) would take from the host's
        buf = bytearray(1 << 18)
        with conn:
            while conn.recv_into(buf):
                pass

    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def send(addr: str, port: int, seconds: float, wait: bool) -> None:
    if wait:
        sys.stdin.readline()
    conn = socket.create_connection((addr, port), timeout=10)
    buf = memoryview(b"\0" * (1 << 16))
    sent, start = 0, time.monotonic()
    deadline = start + seconds
    while time.monotonic() < deadline:
        sent += conn.send(buf)
    # wait until the sink has read everything (it closes on our EOF): the socket buffer
    # holds megabytes that would otherwise still be on the wire after we report
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(120)
    conn.recv(1)
    elapsed = time.monotonic() - start
    conn.close()
    print(json.dumps({"bytes": sent, "seconds": round(elapsed, 4), "mbps": round(sent * 8 / elapsed / 1e6, 3)}),
          flush=True)


def echo(addr: str, port: int) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((addr, port))
    print("ready", flush=True)
    while True:
        data, peer = server.recvfrom(2048)
        # stamp the arrival (CLOCK_MONOTONIC: one clock for both namespaces of a host), so the
        # client can split the round trip into its two directions
        server.sendto(data[:8] + time.monotonic_ns().to_bytes(8, "big") + data[16:], peer)


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rr(addr: str, port: int, seconds: float, rate: float) -> None:
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect((addr, port))
    client.settimeout(0.5)
    samples: List[float] = []
    forward: List[float] = []
    lost = sent = 0
    interval = 1.0 / rate
    start = time.monotonic()
    next_at = start
    while time.monotonic() - start < seconds:
        now = time.monotonic()
        if now < next_at:
            time.sleep(next_at - now)
        next_at += interval
        payload = sent.to_bytes(8, "big") + b"\0" * 56
        sent += 1
        t0 = time.monotonic_ns()
        client.send(payload)
        try:
            while True:
                reply = client.recv(2048)
                if reply[:8] == payload[:8]:
                    break
        except socket.timeout:
            lost += 1
            continue
        samples.append((time.monotonic_ns() - t0) / 1000)
        forward.append((int.from_bytes(reply[8:16], "big") - t0) / 1000)
    print(json.dumps({"sent": sent, "lost": lost, "p50_us": round(percentile(samples, 0.5), 1),
                      "p99_us": round(percentile(samples, 0.99), 1), "samples_us": [round(s, 1) for s in samples],
                      "forward_us": [round(s, 1) for s in forward]}), flush=True)


def main(argv: List[str]) -> None:
    verb, args = argv[0], argv[1:]
    if verb == "sink":
        sink(args[0], int(args[1]))
    elif verb == "send":
        send(args[0], int(args[1]), float(args[2]), "--wait" in args)
    elif verb == "echo":
        echo(args[0], int(args[1]))
    elif verb == "rr":
        rr(args[0], int(args[1]), float(args[2]), float(args[3]))
    else:
        raise SystemExit(f"unknown verb {verb!r}: sink, send, echo or rr")


if __name__ == "__main__":
    main(sys.argv[1:])

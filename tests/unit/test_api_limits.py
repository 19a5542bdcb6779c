"""The agent's API under a connection flood and slow clients: bounded, and never stopped.

Before the fix, ~1,000 idle connections exhausted the agent's file
descriptors: every client was refused and each period logged "Too many open
files". Now each listener holds at most ``MAX_CONNECTIONS``; the rest are
answered 503 and closed at once, and a connection that sends nothing is
closed after ``IDLE_TIMEOUT``.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest

from agent.api import IDLE_TIMEOUT, MAX_CONNECTIONS
from agent.client import AgentClient
from agent.topology.synthetic import Shape, write_tree

FLOOD = 2000


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health_ms(sock_path):
    start = time.perf_counter()
    assert AgentClient(sock_path, timeout=5).request("GET", "/v1/health") == {"ok": True}
    return (time.perf_counter() - start) * 1000


def _tcp_health(port):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := conn.recv(4096):
            data += chunk
    return data.split(b"\r\n", 1)[0]


def _wait_until_serving(agent, sock_path):
    deadline = time.monotonic() + 30
    while True:
        try:
            _health_ms(sock_path)
            return
        except Exception:  # noqa: BLE001 - still starting
            assert agent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)


def test_two_thousand_idle_connections_do_not_stop_the_agent(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 500:  # the test's own side of the flood
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD + 1000), hard))
    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    sock, port = str(tmp_path / "t.sock"), _free_port()
    log = open(tmp_path / "agent.log", "w")
    # as shipped, plus a synthetic tree and recorded cgroups: this tier must not touch the host's kernel
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                              "--cgroups-in-memory", "--socket", sock, "--state-dir", str(tmp_path / "state"),
                              "--tcp-port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    flood = []
    try:
        _wait_until_serving(agent, sock)
        for _ in range(FLOOD):
            conn = socket.socket()
            conn.setblocking(False)
            conn.connect_ex(("127.0.0.1", port))
            flood.append(conn)
        for _ in range(100):  # and idle clients on the socket too
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(sock)
            flood.append(conn)
        time.sleep(1.0)
        # during the flood: the socket answers (its own cap), the TCP port answers 503 and closes
        assert _health_ms(sock) < 100
        assert _tcp_health(port) == b"HTTP/1.1 503 Service Unavailable"
        # the agent holds at most its cap of connections per listener (its own descriptors, counted
        # in /proc: client-side counts include connections the kernel's full accept queue dropped)
        fds = len(os.listdir(f"/proc/{agent.pid}/fd"))
        assert fds <= 2 * MAX_CONNECTIONS + 64, fds
        time.sleep(IDLE_TIMEOUT + 2)  # and lets go of the idle ones it took
        fds = len(os.listdir(f"/proc/{agent.pid}/fd"))
        assert fds <= 64, fds
        for conn in flood:
            conn.close()
        flood.clear()
        time.sleep(0.5)
        # after the flood: both answer at once
        assert _tcp_health(port) == b"HTTP/1.1 200 OK"
        assert max(_health_ms(sock) for _ in range(5)) < 100
        assert agent.poll() is None
    finally:
        for conn in flood:
            conn.close()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=20)
        log.close()
    text = (tmp_path / "agent.log").read_text()
    assert "Too many open files" not in text and "Traceback" not in text, text[-2000:]


@pytest.fixture
def socket_agent(tmp_path):
    """``tidal agent`` on a unix socket (a synthetic tree, recorded cgroups): (socket path, process)."""
    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    sock = str(tmp_path / "t.sock")
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                              "--cgroups-in-memory", "--socket", sock, "--state-dir", str(tmp_path / "state")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_until_serving(agent, sock)
        yield sock, agent
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=20)


def test_a_client_that_sends_half_a_request_is_dropped_and_others_are_served(socket_agent):
    sock, _ = socket_agent
    slow = socket.socket(socket.AF_UNIX)
    slow.connect(sock)
    slow.sendall(b"POST /v1/workloads HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"na")  # and then nothing
    assert _health_ms(sock) < 100  # another client is not held up
    slow.settimeout(IDLE_TIMEOUT + 5)
    start = time.monotonic()
    answer = b""
    while chunk := slow.recv(4096):  # a 408 for the request that never came whole, then the close
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within" in answer, answer
    assert time.monotonic() - start <= IDLE_TIMEOUT + 2
    slow.close()
    assert AgentClient(sock).request("GET", "/v1/workloads") == {"workloads": []}  # nothing half-admitted


def test_a_request_cut_short_in_its_headers_does_nothing(socket_agent):
    """The stdlib's header parser takes the end of the stream as the end of the headers: a DELETE whose
    client went away mid-headers was carried out (and one slow client's abandoned connection answered a
    whole request). Now it is a 400 that says so, and the workload is still there."""
    sock, agent = socket_agent
    client = AgentClient(sock)
    client.request("POST", "/v1/workloads", {"name": "web", "qos": "shared_cores", "cpus": 1})
    for cut in (b"DELETE /v1/workloads/web HTTP/1.1\r\nHost: x\r\n",  # no blank line
                b"DELETE /v1/workloads/web HTTP/1.1\r\n"):  # no header at all
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(sock)
        conn.sendall(cut)
        conn.shutdown(socket.SHUT_WR)  # the end of the stream, the answer still readable
        conn.settimeout(5)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
        conn.close()
        assert answer.startswith(b"HTTP/1.1 400 ") and b"ended before its headers" in answer, answer
    assert [w["name"] for w in client.request("GET", "/v1/workloads")["workloads"]] == ["web"]
    # the whole request, half-closed after its blank line, is carried out
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(sock)
    conn.sendall(b"DELETE /v1/workloads/web HTTP/1.1\r\nHost: x\r\n\r\n")
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(5)
    assert conn.recv(4096).startswith(b"HTTP/1.1 200 ")
    conn.close()
    assert client.request("GET", "/v1/workloads") == {"workloads": []}
    assert agent.poll() is None

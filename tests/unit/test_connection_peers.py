"""Who is on the other end of a loopback TCP connection (``agent.connections``): the kernel's socket
diagnostics asked for the one socket, the socket table as text where netlink cannot be asked. Real sockets
on loopback; the fallback also on a table written here (a uid no test process has)."""

from __future__ import annotations

import os
import socket

import pytest

from agent import connections
from agent.connections import diag_tcp_uid, proc_tcp_uid, tcp_peer_uid


@pytest.fixture(params=[(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")], ids=["v4", "v6"])
def pair(request):
    """A loopback connection: (the client's end as the server sees it, the server's end)."""
    family, address = request.param
    with socket.socket(family) as server:
        try:
            server.bind((address, 0))
        except OSError as exc:
            pytest.skip(f"no {address} here: {exc}")
        server.listen()
        with socket.socket(family) as client:
            client.connect(server.getsockname()[:2])
            conn, peer = server.accept()
            with conn:
                yield peer[:2], conn.getsockname()[:2]


def test_the_kernel_names_the_clients_uid(pair, tmp_path):
    peer, local = pair
    assert diag_tcp_uid(peer, local) == os.getuid()
    # with no socket table to read, the answer still comes: it is the diagnostics', not the table's
    assert tcp_peer_uid(peer, local, proc=str(tmp_path)) == os.getuid()
    assert proc_tcp_uid(peer, local) == os.getuid()


def test_a_kernel_that_finds_nothing_is_not_believed(pair, tmp_path, monkeypatch):
    # a kernel without inet_diag answers ENOENT to every lookup, like one with no such socket: the
    # diagnostics are trusted only once they found a socket this process holds
    peer, local = pair
    monkeypatch.setattr(connections, "_ask", lambda *_: None)
    monkeypatch.setattr(connections, "_diag_works", None)
    assert tcp_peer_uid(peer, local) == os.getuid()  # from the socket table
    assert connections._diag_works is False


def test_no_such_connection_is_no_uid(pair):
    peer, local = pair
    gone = (peer[0], 1)  # nobody's port 1 is connected to this listener
    assert diag_tcp_uid(gone, local) is None
    assert proc_tcp_uid(gone, local) is None
    assert tcp_peer_uid(gone, local) is None


def test_without_netlink_the_socket_table_answers(tmp_path, monkeypatch):
    def no_netlink(*_):
        raise connections._NoDiag("Protocol not supported")

    monkeypatch.setattr(connections, "_ask", no_netlink)
    monkeypatch.setattr(connections, "_diag_works", None)
    (tmp_path / "net").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    # 127.0.0.1:50000 -> 127.0.0.1:8080 (the client's row, uid 1234) and the server's row the other way
    (tmp_path / "net" / "tcp").write_text(
        header
        + "   0: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 11 1\n"
        + "   1: 0100007F:C350 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1234        0 12 1\n")
    # ::1 is three zero words and 01000000 in /proc/net/tcp6's host-order words
    v6 = "00000000000000000000000001000000"
    (tmp_path / "net" / "tcp6").write_text(
        header + f"   0: {v6}:C351 {v6}:1F90 01 00000000:00000000 00:00000000 00000000  4321        0 13 1\n")
    assert tcp_peer_uid(("127.0.0.1", 50000), ("127.0.0.1", 8080), proc=str(tmp_path)) == 1234
    assert tcp_peer_uid(("::1", 50001), ("::1", 8080), proc=str(tmp_path)) == 4321
    assert tcp_peer_uid(("127.0.0.1", 50002), ("127.0.0.1", 8080), proc=str(tmp_path)) is None
    assert tcp_peer_uid(("not an address", 1), ("127.0.0.1", 8080), proc=str(tmp_path)) is None

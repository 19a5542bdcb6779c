"""The agent's unix sockets: the file appears only once the agent listens, with its mode and group, and a
second agent on the same path is one error that leaves the first serving. (A socket file made at bind(),
before listen(), refused a client's connect in the gap: the cgroup v2 VM's CI saw it, a bench's readiness
loop taking the file's presence for the agent's.)"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import pytest

from agent import api
from agent.errors import TidalError


def _connects(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


def _close(server) -> None:
    server.server_close()


def test_the_socket_file_appears_only_once_the_agent_listens(tmp_path, monkeypatch):
    path = str(tmp_path / "agent.sock")
    listen = api._UnixServer.server_activate

    def slow_listen(server):  # a start as slow as a loaded machine's: a gap between bind() and listen()
        time.sleep(0.3)
        listen(server)

    monkeypatch.setattr(api._UnixServer, "server_activate", slow_listen)
    made = []
    starting = threading.Thread(target=lambda: made.append(api._listen_unix(path, "--socket", "unix", None, None,
                                                                            None, 0o600)))
    starting.start()
    try:
        deadline = time.monotonic() + 10
        while not os.path.lexists(path):
            assert time.monotonic() < deadline, "the socket never appeared"
            time.sleep(0.001)
        # the first moment a client can see the file, it can connect
        assert _connects(path)
        starting.join(10)
        assert made and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert sorted(os.listdir(tmp_path)) == ["agent.sock"]  # nothing of the start left beside it
    finally:
        starting.join(10)
        for server in made:
            _close(server)


def test_a_group_socket_appears_with_its_group_and_mode(tmp_path):
    path = str(tmp_path / "agent.sock")
    group = os.getgid()
    server = api._listen_unix(path, "--socket", "unix", None, None, group, 0o660)
    try:
        info = os.stat(path)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == group
        assert _connects(path)
    finally:
        _close(server)


def test_a_second_agent_on_a_live_socket_is_one_error_and_the_first_keeps_serving(tmp_path, monkeypatch):
    path = str(tmp_path / "agent.sock")
    first = api._listen_unix(path, "--socket", "unix", None, None, None, 0o600)
    try:
        with pytest.raises(TidalError, match="another agent is already serving here"):
            api._listen_unix(path, "--socket", "unix", None, None, None, 0o600)
        # the same when the first made the file after the second looked (two agents started at once)
        monkeypatch.setattr(api, "_prepare_socket_path", lambda _path: None)
        with pytest.raises(TidalError, match="another agent is already serving here"):
            api._listen_unix(path, "--socket", "unix", None, None, None, 0o600)
        assert _connects(path) and sorted(os.listdir(tmp_path)) == ["agent.sock"]
    finally:
        _close(first)


def test_what_a_start_killed_midway_left_is_replaced(tmp_path):
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # bound, never listening, then gone
        dead.bind(str(tmp_path / ".agent.sock"))
    server = api._listen_unix(path, "--socket", "unix", None, None, None, 0o600)
    try:
        assert _connects(path) and sorted(os.listdir(tmp_path)) == ["agent.sock"]
    finally:
        _close(server)


def test_a_path_too_long_for_the_staging_name_is_bound_itself(tmp_path):
    # sun_path holds 107 bytes and a NUL: a path of 107 has no room for the staging name's extra dot
    deep = tmp_path / ("d" * (107 - len(str(tmp_path)) - len("/") - len("/x.sock")))
    deep.mkdir()
    path = str(deep / "x.sock")
    assert len(path) == 107
    server = api._listen_unix(path, "--socket", "unix", None, None, None, 0o600)
    try:
        assert _connects(path) and os.listdir(deep) == ["x.sock"]
    finally:
        _close(server)

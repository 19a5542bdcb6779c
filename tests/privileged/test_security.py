"""A hostile local user against the agent: what it can read, and that it can change nothing it should not.

A real non-root user (made with ``useradd`` for this test, removed after)
talks to a running ``tidal agent`` through its loopback TCP port and, as a
member of ``--socket-group``, through its unix socket. Its requests run in
Debian's own ``/usr/bin/python3`` (stdlib only: the project's venv lives
under root's home, which the user cannot enter). The agent reads a
synthetic topology and records its cgroup writes: authority is decided
before any kernel work, so the real kernel adds nothing here (the kernel
tiers cover attach and eviction).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from tests.conftest import is_root
from tests.privileged.local_user import run_as, wait_listening

pytestmark = [pytest.mark.privileged,
              pytest.mark.skipif(not is_root() or not os.path.exists("/usr/sbin/useradd"),
                                 reason="needs root and useradd: creates a user")]




def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stranger():
    """A non-root user and a group for the socket; removed afterwards."""
    name = f"tdlsec{uuid.uuid4().hex[:6]}"
    subprocess.run(["groupadd", name], check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "-g", name, name], check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", name], check=False, capture_output=True)


def as_user(user, plan):
    """The statuses of ``plan``'s requests made as ``user`` (``tests/privileged/local_user.py``)."""
    return [got[0] for got in run_as(user, [step[:3] + ([step[3]] if len(step) > 3 else []) +
                                                 ([{"Authorization": "Bearer " + step[4]}] if len(step) > 4 else [])
                                                 for step in plan])]


def test_a_local_user_reads_but_cannot_drive_the_agent(tmp_path, stranger):
    from agent.client import AgentClient
    from agent.topology.synthetic import Shape, write_tree

    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=4))
    sockdir = tempfile.mkdtemp(prefix="tidal-test-sec-")  # pytest's own tmp is root's alone: the user must reach it
    os.chmod(sockdir, 0o755)
    sock, port, token = os.path.join(sockdir, "t.sock"), _free_port(), uuid.uuid4().hex * 2
    (tmp_path / "token").write_text(token + "\n")
    os.chmod(tmp_path / "token", 0o600)
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                              "--cgroups-in-memory", "--socket", sock, "--state-dir", str(tmp_path / "state"),
                              "--tcp-port", str(port), "--tcp-token-file", str(tmp_path / "token"),
                              "--socket-group", stranger.pw_name],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sleeper = None
    try:
        wait_listening(agent, sock)
        root = AgentClient(sock)
        root.request("POST", "/v1/workloads", {"name": "roots", "qos": "shared_cores", "millicpu": 100})
        before = (root.request("GET", "/v1/node")["state"], sorted(w["name"] for w in
                                                                   root.request("GET", "/v1/workloads")["workloads"]))
        tcp = str(port)
        # TCP without a token: the four read-only endpoints, nothing else
        got = as_user(stranger, [
            [tcp, "GET", "/v1/health"], [tcp, "GET", "/v1/capacity"], [tcp, "GET", "/metrics"],
            [tcp, "GET", "/v1/status"],
            [tcp, "GET", "/v1/workloads"], [tcp, "POST", "/v1/node/lend", {"notice": "0s"}],
            [tcp, "POST", "/v1/node/reclaim", {"notice": "0s"}],
            [tcp, "POST", "/v1/workloads", {"name": "x", "qos": "reclaimed_cores", "millicpu": 100}],
            [tcp, "POST", "/v1/workloads/roots/attach", {"pid": 1}], [tcp, "DELETE", "/v1/workloads/roots"],
            [tcp, "POST", "/v1/node/lend", {"notice": "0s"}, "not-the-token-at-all"],
        ])
        assert got == [200, 200, 200, 200, 403, 403, 403, 403, 403, 403, 403]
        # the socket, as a member of --socket-group: a user's authority
        sleeper = subprocess.Popen(["sleep", "120"], user=stranger.pw_uid, group=stranger.pw_gid)
        got = as_user(stranger, [
            [sock, "GET", "/v1/status"], [sock, "GET", "/v1/workloads"],
            [sock, "POST", "/v1/node/lend", {"notice": "0s"}], [sock, "POST", "/v1/node/reclaim", {"notice": "0s"}],
            [sock, "POST", "/v1/workloads/roots/attach", {"pid": sleeper.pid}],  # root's workload
            [sock, "DELETE", "/v1/workloads/roots"],
            [sock, "POST", "/v1/workloads", {"name": "mine", "qos": "reclaimed_cores", "millicpu": 100}],
            [sock, "POST", "/v1/workloads/mine/attach", {"pid": 1}],  # root's process: never
            [sock, "POST", "/v1/workloads/mine/attach", {"pid": sleeper.pid}],  # its own
            [sock, "DELETE", "/v1/workloads/mine"],
        ])
        assert got == [200, 200, 403, 403, 403, 403, 201, 403, 200, 200]
        after = (root.request("GET", "/v1/node")["state"], sorted(w["name"] for w in
                                                                  root.request("GET", "/v1/workloads")["workloads"]))
        assert after == before == ("Online", ["roots"])  # nothing the refused requests asked for happened
        # with the token, TCP is root's
        got = as_user(stranger, [[tcp, "POST", "/v1/workloads", {"name": "tok", "qos": "shared_cores",
                                                                  "millicpu": 100}, token],
                                 [tcp, "DELETE", "/v1/workloads/tok", None, token]])
        assert got == [201, 200]
        # root's socket stays root's without --socket-group: the mode says so
        assert oct(os.stat(sock).st_mode & 0o777) == "0o660" and os.stat(sock).st_gid == stranger.pw_gid
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=20)
        shutil.rmtree(sockdir, ignore_errors=True)


def test_a_token_file_others_can_read_is_refused_with_one_line(tmp_path):
    (tmp_path / "token").write_text("x" * 32)
    os.chmod(tmp_path / "token", 0o644)
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--cgroups-in-memory", "--socket",
                           str(tmp_path / "t.sock"), "--state-dir", str(tmp_path / "s"), "--tcp-port",
                           str(_free_port()), "--tcp-token-file", str(tmp_path / "token")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "must be owned by root with mode 0600 or 0400" in lines[0], done.stderr

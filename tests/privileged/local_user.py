"""A real local user's requests to the agent, for the security tests: made with ``useradd``, removed
after, its requests run in Debian's own ``/usr/bin/python3`` (stdlib only: the project's venv lives under
root's home, which the user cannot enter)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

CLIENT = r'''
import http.client, json, socket, sys, time

class Unix(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=10)
        self.path_ = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path_)

def call(where, method, path, body=None, headers=None, raw=None):
    conn = Unix(where) if where.startswith("/") else http.client.HTTPConnection("127.0.0.1", int(where), timeout=10)
    start = time.monotonic()
    try:
        data = raw.encode("latin-1") if raw is not None else None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
        return [response.status, text[:300], time.monotonic() - start]
    except OSError as exc:
        return ["refused", str(exc), time.monotonic() - start]
    finally:
        conn.close()

plan = json.loads(sys.stdin.read())
print(json.dumps([call(*step) for step in plan]))
'''


def run_as(user, plan, groups=()):
    """Each ``[where, method, path, body?, headers?, raw?]`` of ``plan`` as ``user``: ``[[status, text, seconds],
    ...]`` (``where``: a unix socket path, or a loopback TCP port; ``seconds``: from connecting to the answer,
    the interpreter's own start left out)."""
    done = subprocess.run(["/usr/bin/python3", "-c", CLIENT], input=json.dumps(plan), user=user.pw_uid,
                          group=user.pw_gid, extra_groups=[user.pw_gid, *groups], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def wait_listening(proc: subprocess.Popen, path: str, seconds: float = 90) -> None:
    """Wait for the agent ``proc`` (stdout a pipe) to make ``path``; a failure carries its output. An agent
    still running past ``seconds`` is killed first: reading the pipe of a live one would wait forever (a
    test hung so under a loaded host's emulation, where the agent's start took longer than 30 s)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0] or ""
            pytest.fail(f"the agent did not make {path} within {seconds:g} s (exit {proc.returncode}): "
                        f"{out[-3000:]}")
        time.sleep(0.05)

"""A hostile local user against the agent as shipped, second pass: each attack that once worked.

Real non-root users (made with ``useradd`` for the test, removed after) talk to a running ``tidal
agent`` (a process, its shipped defaults but a synthetic topology and recorded cgroups: authority and
parsing are decided before any kernel work). Their requests run in Debian's own ``/usr/bin/python3``.
Every attack here worked on the agent before this suite was written:

* slow clients (one header line every few seconds) on every slot of the socket and the TCP port
  locked out root, the token holder and the NRI plugin (503 for everyone);
* any socket caller could say it was the registered NRI plugin (``X-Tidal-NRI``), admit
  ``system_cores`` work beside the agent, or admit without limit;
* a pod's workload name could be taken by a local caller first;
* numbers of 400 digits, ``1e400``, JSON nested 5,000 deep and names of cgroup control files gave
  500s (or a half-made workload).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from tests.cgroup_trees import remove_cgroup_tree
from tests.conftest import is_root
from tests.privileged.local_user import run_as, wait_listening

pytestmark = [pytest.mark.privileged,
              pytest.mark.skipif(not is_root() or not os.path.exists("/usr/sbin/useradd"),
                                 reason="needs root and useradd: creates users")]



# one user's slow clients: N connections per listener, each sending one header line every 2 s (never a whole
# request), each reconnected when the agent closes it, for SECONDS
SLOW = r'''
import socket, sys, threading, time
where, count, seconds = sys.argv[1].split(","), int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + seconds
held = []

def one(target):
    while time.monotonic() < end:
        try:
            if target.startswith("/"):
                s = socket.socket(socket.AF_UNIX); s.connect(target)
            else:
                s = socket.create_connection(("127.0.0.1", int(target)))
            s.settimeout(3)
            s.sendall(b"GET /v1/health HTTP/1.1\r\n")
            while time.monotonic() < end:
                time.sleep(2)
                s.sendall(b"X-Slow: 1\r\n")
                try:
                    if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        break
                except BlockingIOError:
                    pass
        except OSError:
            time.sleep(0.2)

threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in where for _ in range(count)]
for t in threads: t.start()
print("flooding", flush=True)
time.sleep(seconds)
'''


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user(tag: str, group: str = None):
    name = f"tdl{tag}{uuid.uuid4().hex[:5]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin"]
                   + (["-G", group] if group else []) + [name], check=True)
    return pwd.getpwnam(name)


@pytest.fixture
def users():
    """An attacker (a --socket-group member) and an honest user (the token holder, and the NRI plugin's uid)."""
    group = f"tdlsg{uuid.uuid4().hex[:5]}"
    subprocess.run(["groupadd", group], check=True)
    made = []
    try:
        attacker = _user("a", group)
        made.append(attacker)
        honest = _user("h")
        made.append(honest)
        yield {"attacker": attacker, "honest": honest, "group": group}
    finally:
        for user in made:
            subprocess.run(["userdel", user.pw_name], check=False, capture_output=True)
        subprocess.run(["groupdel", group], check=False, capture_output=True)


def as_user(user, plan, group=None):
    return run_as(user, plan, [group] if group else [])


class Slices:
    """Two sibling cpu cgroups of equal weight, as a systemd host gives the agent's unit (system.slice) and a
    local user's session (user.slice): the kernel shares the cpu between the two, not between their threads.
    In one cgroup the flood's hundreds of threads outweighed the agent's accept loop on a starved emulated
    cpu (the v2 tier under a loaded host: the token holder's connection waited 10 s in a full accept queue);
    the shipped unit and DaemonSet never run the agent in a user's cgroup."""

    def __init__(self) -> None:
        from agent.isolation.cgroups.detect import detect
        from agent.topology import HostFS

        mounts = detect(HostFS("/"))
        root = mounts.mount_of("cpu")
        self.top = os.path.join(root, f"tidal-test-sec-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.top)
        if mounts.version == 2:
            for parent in (root, self.top):
                with open(os.path.join(parent, "cgroup.subtree_control"), "w") as handle:
                    handle.write("+cpu")
        for name in ("agent", "user"):
            os.mkdir(os.path.join(self.top, name))

    def join(self, name: str, pid: int) -> None:
        with open(os.path.join(self.top, name, "cgroup.procs"), "w") as handle:
            handle.write(str(pid))

    def remove(self) -> None:
        assert remove_cgroup_tree(self.top), f"{self.top} stayed"


@pytest.fixture
def slices():
    made = Slices()
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture
def agent(tmp_path, users, slices):
    """``tidal agent`` as shipped, with a socket group, a token for TCP and a plugin socket."""
    from agent.topology.synthetic import Shape, write_tree

    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=4))
    sockdir = tempfile.mkdtemp(prefix="tidal-test-sec-")  # pytest's own tmp is root's alone: users must reach it
    os.chmod(sockdir, 0o755)
    token = uuid.uuid4().hex * 2
    (tmp_path / "token").write_text(token + "\n")
    os.chmod(tmp_path / "token", 0o600)
    where = {"sock": os.path.join(sockdir, "t.sock"), "plugin": os.path.join(sockdir, "plugin", "p.sock"),
             "tcp": str(_free_port()), "token": token}
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                             "--cgroups-in-memory", "--socket", where["sock"], "--state-dir", str(tmp_path / "state"),
                             "--tcp-port", where["tcp"], "--tcp-token-file", str(tmp_path / "token"),
                             "--socket-group", users["group"], "--plugin-socket", where["plugin"],
                             "--plugin-uid", str(users["honest"].pw_uid), "--max-workloads-per-user", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    slices.join("agent", proc.pid)
    wait_listening(proc, where["plugin"])
    where["proc"] = proc
    try:
        yield where
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:  # once, under emulation (not seen again): what each thread was doing
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            out = proc.communicate()[0]
            shutil.rmtree(sockdir, ignore_errors=True)
            raise AssertionError(f"the agent did not stop within 30 s of SIGTERM; its threads:\n{out[-8000:]}")
        shutil.rmtree(sockdir, ignore_errors=True)
        assert "Traceback" not in out, out[-3000:]


def test_one_users_slow_clients_leave_root_the_token_holder_and_the_plugin_served(agent, users, slices):
    from agent.api import MAX_CONNECTIONS
    from agent.client import AgentClient
    from agent.connections import MAX_PER_PEER

    attacker = users["attacker"]
    # the flood lasts until the test kills it: a 90 s flood once ended before the third round under a slow
    # CI machine's emulation (capping alone may take a minute there), and the attacker's own request was served
    flood = subprocess.Popen(["/usr/bin/python3", "-c", SLOW, f"{agent['sock']},{agent['tcp']}",
                              str(MAX_CONNECTIONS), "900"], user=attacker.pw_uid, group=attacker.pw_gid,
                             extra_groups=[users["group"]], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        slices.join("user", flood.pid)  # before its threads start: it prints "flooding" once they have
        assert flood.stdout.readline().strip() == "flooding"
        root = AgentClient(agent["sock"], timeout=5)

        def capped() -> bool:  # the attacker holds its share of both listeners and is being turned away
            api = root.request("GET", "/v1/status")["api"]
            return all(api[via]["requests"]["refused"] > 0 and api[via]["requests"]["used"] >= MAX_PER_PEER
                       for via in ("unix", "tcp"))

        deadline = time.monotonic() + 60  # under the v2 tier's emulation 512 threads take a while to connect
        while not capped():
            assert time.monotonic() < deadline and flood.poll() is None, root.request("GET", "/v1/status")["api"]
            time.sleep(0.2)
        for round_ in range(3):  # across the 10 s request deadline: the flood reconnects, the others stay served
            assert flood.poll() is None, f"the flood stopped before round {round_}"
            # each answered at once, not after a slot the deadline freed: root within its client's 5 s, the
            # others timed from their connect (the user's interpreter start, 1-3 s under the v2 tier's
            # emulation, is not the agent's)
            start = time.monotonic()
            assert AgentClient(agent["sock"], timeout=5).request("GET", "/v1/health") == {"ok": True}  # root
            root_s = time.monotonic() - start
            assert root_s < 5
            token = {"Authorization": f"Bearer {agent['token']}"}
            got = as_user(users["honest"], [
                [agent["tcp"], "GET", "/v1/workloads", None, token],  # the token holder
                [agent["plugin"], "GET", "/v1/assignments", None, {"X-Tidal-NRI": "registered"}],  # the plugin
            ])
            assert [g[0] for g in got] == [200, 200], got
            print(f"round {round_}: root {root_s:.3f} s, the token holder {got[0][2]:.3f} s, the plugin "
                  f"{got[1][2]:.3f} s; tcp {root.request('GET', '/v1/status')['api']['tcp']}")
            assert all(g[2] < 5 for g in got), got
            # the attacker itself gets no more than its share: one more request of its own is turned away.
            # Its flood takes back a slot the 10 s deadline closed within ~0.2-2 s, and a request landing in
            # that gap is fairly served (the v2 tier's emulation once did): asked up to 10 times, it is
            # refused while its share is full (the descriptor count below bounds what it ever held)
            tries = []
            for _ in range(10):
                tries.append(as_user(attacker, [[agent["sock"], "GET", "/v1/health"]], group=users["group"])[0][0])
                if tries[-1] in (503, "refused"):
                    break
                time.sleep(0.3)
            assert tries[-1] in (503, "refused"), tries
            time.sleep(4)
        # the agent held at most its share for the attacker on each listener (its own descriptors, counted)
        fds = len(os.listdir(f"/proc/{agent['proc'].pid}/fd"))
        assert fds <= 2 * MAX_PER_PEER + 64, fds
    finally:
        flood.kill()
        flood.wait()


def test_only_the_plugin_socket_may_say_the_plugin_is_registered(agent, users):
    from agent.client import AgentClient

    root = AgentClient(agent["sock"])
    got = as_user(users["attacker"], [[agent["sock"], "GET", "/v1/assignments", None, {"X-Tidal-NRI": "registered"}]],
                  group=users["group"])
    assert got[0][0] == 200
    assert root.request("GET", "/v1/status")["runtime"]["nri_plugin"] == "not heard from"
    # the attacker cannot reach the plugin socket (owned by the plugin's uid, 0600)
    got = as_user(users["attacker"], [[agent["plugin"], "GET", "/v1/assignments"]], group=users["group"])
    assert got[0][0] == "refused", got
    got = as_user(users["honest"], [[agent["plugin"], "GET", "/v1/assignments", None, {"X-Tidal-NRI": "registered"}],
                                    [agent["plugin"], "POST", "/v1/workloads",
                                     {"name": "x", "qos": "shared_cores", "millicpu": 10}]])
    assert [g[0] for g in got] == [200, 403], got  # read-only, even for the plugin
    assert root.request("GET", "/v1/status")["runtime"]["nri_plugin"] == "registered"


def test_a_user_may_not_run_system_work_nor_admit_without_limit(agent, users):
    from agent.client import AgentClient

    sock = agent["sock"]
    plan = [[sock, "POST", "/v1/workloads", {"name": "sys", "qos": "system_cores"}]]
    plan += [[sock, "POST", "/v1/workloads", {"name": f"w{i}", "qos": "reclaimed_cores", "millicpu": 1}]
             for i in range(7)]
    got = as_user(users["attacker"], plan, group=users["group"])
    assert got[0][0] == 403 and "system_cores" in got[0][1]
    assert [g[0] for g in got[1:]] == [201] * 5 + [403, 403]
    assert "--max-workloads-per-user 5" in got[6][1]
    names = {w["name"] for w in AgentClient(sock).request("GET", "/v1/workloads")["workloads"]}
    assert names == {f"w{i}" for i in range(5)}  # and root is not bound by it
    AgentClient(sock).request("POST", "/v1/workloads", {"name": "rootsys", "qos": "system_cores"})


def test_no_local_name_can_be_a_pods_or_a_control_files(agent, users):
    from agent.client import AgentClient

    sock = agent["sock"]
    names = ["pod/0f1e22aa-bb", "tasks", "cgroup.procs", "cpu.shares", "memory.limit_in_bytes", "cpuset.cpus",
             "notify_on_release"]
    got = as_user(users["attacker"], [[sock, "POST", "/v1/workloads", {"name": n, "qos": "shared_cores",
                                                                        "millicpu": 10}] for n in names],
                  group=users["group"])
    assert [g[0] for g in got] == [400] * len(names), got
    assert AgentClient(sock).request("GET", "/v1/workloads") == {"workloads": []}


@pytest.mark.parametrize("raw, why", [
    ('{"name": "n", "qos": "shared_cores", "millicpu": ' + "9" * 400 + "}", "400 digits"),
    ('{"name": "n", "qos": "dedicated_cores", "cpus": 1e400}', "out of range"),
    ('{"name": "n", "qos": "dedicated_cores", "cpus": 2, "memory_enhancement": "' + "[" * 5000 + '"}', "nested"),
    ("[" * 200_000 + "]" * 200_000, "nested"),
    ('{"name": "n", "qos": "shared_cores", "millicpu": NaN}', "NaN"),
    ('{"name": "n", "qos": "dedicated_cores", "cpus": 100000}', "this node has"),
], ids=["digits", "infinite", "nested-annotation", "nested-body", "nan", "larger-than-the-node"])
def test_bad_numbers_and_nesting_are_400_with_one_line(agent, users, raw, why):
    from agent.client import AgentClient

    got = as_user(users["attacker"], [[agent["sock"], "POST", "/v1/workloads", None, None, raw]], group=users["group"])
    status, text = got[0][:2]
    assert status == 400, got
    error = json.loads(text)["error"]
    assert why in error and "\n" not in error, error
    assert AgentClient(agent["sock"]).request("GET", "/v1/workloads") == {"workloads": []}

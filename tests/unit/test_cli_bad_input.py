"""Every CLI mistake is one ``tidal: error:`` line and exit 2: no traceback, nothing left behind.

Each row is something a user (or a script) gave ``tidal`` that once ended in
a Python traceback, a hang, a wrong action or a deleted file (#17).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.topology.synthetic import Shape, write_tree


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("clitree")
    write_tree(str(root), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    return str(root)


def tidal(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "agent.cli", *argv], capture_output=True, timeout=timeout)


def file_with(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def shapes_with(tmp_path, archive: bytes) -> str:
    """A --shapes directory holding one machine, 16amd64-8n2c, as this archive."""
    (tmp_path / "shapes").mkdir()
    file_with(tmp_path / "shapes", "16amd64-8n2c.tar.bz2", archive)
    return str(tmp_path / "shapes")


def serving_cert(t) -> list:
    """``--tls-cert``/``--tls-key`` of a real self-signed pair, made in ``t``."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=m",
                    "-keyout", str(t / "m.key"), "-out", str(t / "m.crt")], check=True, capture_output=True)
    return ["--tls-cert", str(t / "m.crt"), "--tls-key", str(t / "m.key")]


CASES = [
    ("plan-infinity", lambda t, r: ["plan", "--root", r, "--requests", file_with(t, "r.json", b'[{"name":"a","qos":"shared_cores",'
                                                                              b'"millicpu":1e400}]')], "1e400 is out of range"),
    ("plan-huge-int", lambda t, r: ["plan", "--root", r, "--requests", file_with(t, "r.json", b'[{"name":"a","millicpu":'
                                                                               + b"9" * 5000 + b"}]")], "digits"),
    ("plan-deep", lambda t, r: ["plan", "--root", r, "--requests", file_with(t, "r.json", b"[" * 100_000 + b"]" * 100_000)],
     "nested too deeply"),
    ("plan-binary", lambda t, r: ["plan", "--root", r, "--requests", file_with(t, "r.json", b"\x00\xff\xfe\x80 junk")],
     "not UTF-8"),
    ("plan-latin1", lambda t, r: ["plan", "--root", r, "--requests", file_with(t, "r.json", '[{"name":"caf\xe9"}]'.encode("latin-1"))],
     "not UTF-8"),
    ("push-command-deep", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                        "--socket", str(t / "a.sock"), "--push-command", "[" * 100_000],
     "--push-command: expected a JSON list"),
    ("offline-cgroup-dotdot", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                            "--socket", str(t / "a.sock"), "--offline-cgroup", "/yarn/../etc"],
     "--offline-cgroup: expected a cgroup path"),
    ("offline-cgroup-in-tidal", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                              "--socket", str(t / "a.sock"), "--offline-cgroup", "tidal/reclaimed"],
     "inside Tidal's own tree"),
    ("yarn-rm-not-a-url", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                        "--socket", str(t / "a.sock"), "--yarn-rm", "rm:8088"],
     "--yarn-rm: expected the ResourceManager's web address"),
    ("yarn-node-alone", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                      "--socket", str(t / "a.sock"), "--yarn-node-id", "n1:8041"],
     "go with --yarn-rm"),
    ("yarn-node-id-bad", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                       "--socket", str(t / "a.sock"), "--yarn-rm", "http://rm:8088",
                                       "--yarn-node-id", "n1 8041"], "--yarn-node-id: expected HOST:PORT"),
    ("socket-in-proc", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                     "--socket", "/proc/tidal-x.sock"], "--socket /proc/tidal-x.sock"),
    ("socket-is-a-file", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                       "--socket", file_with(t, "precious", b"keep me")], "is not a socket"),
    ("reserved-huge", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                    "--socket", str(t / "a.sock"), "--reserved-cpus", "0-999999999"], "above 65535"),
    ("simulate-binary-trace", lambda t, r: ["cluster", "simulate", "--nodes", "4", "--hours", "1", "--trace",
                                            file_with(t, "t.csv", b"\x00\xff\xfe\x80" * 100)], "not UTF-8"),
    ("release-space", lambda t, r: ["release", "a b", "--socket", str(t / "none.sock")], "no agent at"),
    ("release-question-mark", lambda t, r: ["release", "a?b", "--socket", str(t / "none.sock")], "no agent at"),
    ("unknown-option", lambda t, r: ["plan", "--bogus"], "No such option"),
    ("bad-choice", lambda t, r: ["capacity", "--format", "xml"], "'xml' is not one of"),
    ("cgroup-base-empty", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                        "--socket", str(t / "a.sock"), "--cgroup-base", ""], "relative path of names"),
    # a NaN passed every FloatRange (it compares false to both bounds): an agent ran with a NaN period
    ("period-nan", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                 "--socket", str(t / "a.sock"), "--period", "nan"], "not a finite number"),
    ("eviction-grace-inf", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                         "--socket", str(t / "a.sock"), "--eviction-grace", "inf"], "not in the range"),
    ("run-cpus-nan", lambda t, r: ["run", "--socket", str(t / "none.sock"), "--cpus", "nan", "--", "true"],
     "not a finite number"),
    ("yarn-config-not-a-url", lambda t, r: ["yarn", "config", "--rm", "notaurl"], "--rm: expected the ResourceManager"),
    ("nm-cgroup-dotdot", lambda t, r: ["agent", "--root", r, "--cgroups-in-memory", "--state-dir", str(t / "s"),
                                       "--socket", str(t / "a.sock"), "--yarn-nodemanager-cgroup", "/a/../b"],
     "--yarn-nodemanager-cgroup: expected a cgroup path"),
    ("offline-run-with-qos", lambda t, r: ["run", "--socket", str(t / "none.sock"), "--offline-cgroup", "/y", "--qos",
                                           "reclaimed_cores", "--", "true"], "--qos does not go with it"),
    ("scheduler-backoff-upside-down", lambda t, r: ["cluster", "scheduler", "--kubeconfig", str(t / "none"),
                                                    "--pod-initial-backoff", "5", "--pod-max-backoff", "1"],
     "--pod-initial-backoff 5 is above --pod-max-backoff 1"),
    ("day-metrics-gap-bad", lambda t, r: ["bench", "day", "--metrics-gap", "25:00-26:00"],
     "--metrics-gap '25:00-26:00': expected HH:MM-HH:MM"),
    ("day-trace-bad-node", lambda t, r: ["bench", "day", "--nodes", "3", "--trace", file_with(
        t, "t.csv", b"minute,kind,name,cores,duration_min,tier,node\n0,offline,j,2,30,low,node-3\n")],
     "unknown node id 'node-3' (the cluster has node-0 .. node-2)"),
    ("day-shape-unknown", lambda t, r: ["bench", "day", "--shape", "nosuch"],
     "--shape nosuch: not among the machines (128arm-2pa2n8cluster4co, 16amd64-8n2c"),
    # the flags are checked before any machine's tree is extracted (this archive is not a tree at all)
    ("day-flags-before-trees", lambda t, r: ["bench", "day", "--shapes", shapes_with(t, b"not bzip2"),
                                             "--metrics-gap", "7:00-25:00"], "--metrics-gap '7:00-25:00': expected"),
    # the serving certificate is read before the API server is asked anything (none runs here)
    ("metrics-tls-missing", lambda t, r: ["cluster", "metrics", "--kubeconfig", str(t / "none"), "--tls-cert",
                                          str(t / "no.crt"), "--tls-key", str(t / "no.key")],
     "metrics TLS: --tls-cert"),
    ("metrics-tls-not-pem", lambda t, r: ["cluster", "metrics", "--kubeconfig", str(t / "none"), "--tls-cert",
                                          file_with(t, "c.crt", b"not pem"), "--tls-key", file_with(t, "k", b"x")],
     "metrics TLS: --tls-cert"),
    ("metrics-no-api-server", lambda t, r: ["cluster", "metrics", "--kubeconfig", file_with(
        t, "kc", b"apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]\n"
                 b"users: [{name: u, user: {token: x}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
                 b"current-context: c\n"), *serving_cert(t)], "cannot reach the API server"),
    ("day-metrics-gap-no-hpa", lambda t, r: ["bench", "day", "--no-hpa", "--metrics-gap", "08:00-09:00"],
     "--metrics-gap: the metrics are the HPA's"),
]


@pytest.mark.parametrize("make, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_error_line_and_exit_2(tmp_path, tree, make, expect):
    done = tidal(*make(tmp_path, tree))
    err = done.stderr.decode(errors="replace")
    lines = [line for line in err.splitlines() if line.strip()]
    assert done.returncode == 2, err
    assert len(lines) == 1 and lines[0].startswith("tidal: error:") and expect in lines[0], err
    assert b"Traceback" not in done.stdout + done.stderr
    if (tmp_path / "precious").exists():
        assert (tmp_path / "precious").read_bytes() == b"keep me"  # never deleted for a socket


def test_topology_of_a_tree_with_a_fifo_does_not_hang(tmp_path):
    write_tree(str(tmp_path), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    online = tmp_path / "sys/devices/system/cpu/online"
    online.unlink()
    os.mkfifo(online)  # reading it would block forever
    done = tidal("topology", "--root", str(tmp_path), "--json", timeout=30)
    assert done.returncode == 0, done.stderr
    assert b'"cpus"' in done.stdout


def test_an_agent_that_dies_mid_answer_is_one_error_line(tmp_path):
    """An agent SIGKILLed while it answers leaves a short response; the CLI says so, with no traceback."""
    import socket
    import threading

    path = str(tmp_path / "dying.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def answer_half():
        conn, _ = server.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 684\r\n\r\n{\"work")
        conn.close()

    thread = threading.Thread(target=answer_half, daemon=True)
    thread.start()
    done = tidal("ps", "--socket", path)
    thread.join(timeout=10)
    server.close()
    err = done.stderr.decode(errors="replace")
    lines = [line for line in err.splitlines() if line.strip()]
    assert done.returncode == 2, err
    assert len(lines) == 1 and "closed the connection before it answered" in lines[0], err


def test_a_captured_tree_tar_cannot_extract_is_one_error_naming_the_archive(tmp_path):
    from agent.cli.bench import _captured_trees
    from agent.errors import TidalError

    shapes = shapes_with(tmp_path, b"not bzip2")
    with pytest.raises(TidalError, match=r"16amd64-8n2c\.tar\.bz2: not a tree tar could extract \(.+\)"):
        _captured_trees(shapes)
    with pytest.raises(TidalError, match=r"--shape 2arm-2c: not among the machines \(16amd64-8n2c\)"):
        _captured_trees(shapes, only="2arm-2c")


def test_one_machine_asked_for_is_the_one_extracted():
    from agent.cli.bench import _captured_trees

    roots = _captured_trees(None, only="2arm-2c")
    assert list(roots) == ["2arm-2c"] and os.path.isdir(os.path.join(roots["2arm-2c"], "sys", "devices", "system", "cpu"))


@pytest.mark.parametrize("argv", [(), ("node",), ("bench",)], ids=["tidal", "tidal node", "tidal bench"])
def test_a_group_without_its_command_shows_its_help_not_an_error_line(argv):
    done = tidal(*argv)
    err = done.stderr.decode()
    assert done.returncode == 2 and done.stdout == b"", err
    assert err.startswith(f"Usage: tidal {' '.join(argv)}".rstrip() + " [OPTIONS] COMMAND") and "tidal: error" not in err
    assert "\nCommands:\n" in err

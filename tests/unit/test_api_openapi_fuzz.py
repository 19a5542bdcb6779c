"""Schemathesis against a live agent, from the agent's own OpenAPI document: never a 5xx, never a traceback.

The agent runs as shipped (a process; a synthetic topology and recorded cgroups, so nothing touches the
host) with its loopback TCP port and a bearer token, which gives the fuzzer root's authority: every
write path is open to it. Schemathesis reads ``GET /openapi.json`` (the document the API reference is
made from) and runs its coverage, fuzzing and stateful phases (a workload it admits is released and
attached to, by the document's links). Two runs: the workload paths with the node kept Online (a lent
node places nothing, which would hide them), then the node's lending paths with the rest.

Checks: no 5xx (``not_a_server_error``), every status and content type the document names, every answer
matching its schema; the agent's log holds no traceback. The figures (requests by status) are printed.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from agent.topology.synthetic import Shape, write_tree

ST = shutil.which("st", path=os.path.dirname(sys.executable))
SECONDS = int(os.environ.get("TIDAL_FUZZ_SECONDS", "45"))
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(ST is None, reason="schemathesis is a test extra: pip install -e '.[test]'")
def test_schemathesis_finds_no_5xx_and_no_traceback(tmp_path):
    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=2, cores_per_numa=4))
    token = os.urandom(16).hex()
    (tmp_path / "token").write_text(token)
    os.chmod(tmp_path / "token", 0o600)
    port = _free_port()
    log = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp_path / "root"),
                              "--cgroups-in-memory", "--socket", str(tmp_path / "a.sock"), "--state-dir",
                              str(tmp_path / "state"), "--tcp-port", str(port), "--tcp-token-file",
                              str(tmp_path / "token")], stdout=log, stderr=subprocess.STDOUT)
    statuses = collections.Counter()
    by_operation = collections.Counter()
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(tmp_path / "a.sock"):
            assert agent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        for run, selection in (("workloads", ["--exclude-operation-id", "lend", "--exclude-operation-id", "reclaim"]),
                               ("node", [])):
            report = tmp_path / f"report-{run}"
            done = subprocess.run([ST, "run", f"http://127.0.0.1:{port}/openapi.json", "-H",
                                   f"Authorization: Bearer {token}", "--checks", CHECKS, "--max-time", str(SECONDS),
                                   "--workers", "1", "--report", "har", "--report-dir", str(report),
                                   "--seed", "20261125", *selection],
                                  capture_output=True, text=True, timeout=SECONDS * 4 + 120)
            assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
            for path in glob.glob(str(report / "*.json")):
                for entry in json.load(open(path))["log"]["entries"]:
                    status = entry["response"]["status"]
                    statuses[status] += 1
                    route = entry["request"]["url"].split(str(port), 1)[1].split("?")[0]
                    route = "/v1/workloads/{name}" + ("/attach" if route.endswith("/attach") else "") \
                        if route.startswith("/v1/workloads/") else route
                    by_operation[(entry["request"]["method"], route, status)] += 1
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
        log.close()
    print(f"schemathesis: {sum(statuses.values())} requests; by status {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) > 500
    assert not [s for s in statuses if s >= 500], statuses
    # the fuzzer reached the write paths, not only the refusals
    assert by_operation[("POST", "/v1/workloads", 201)] > 0, by_operation
    assert by_operation[("DELETE", "/v1/workloads/{name}", 200)] > 0, by_operation
    assert by_operation[("POST", "/v1/node/lend", 200)] > 0, by_operation
    text = (tmp_path / "agent.log").read_text()
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]

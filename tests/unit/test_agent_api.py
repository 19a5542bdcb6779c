"""The agent's API and CLI against an in-process agent whose kernel writes are recorded."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.client import AgentClient
from agent.isolation.cgroups.recording import RecordingCgroups
from agent.topology.synthetic import Shape, build_topology

TOPO = build_topology(Shape(sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=2))


@pytest.fixture()
def agent(make_agent):
    agent = make_agent(TOPO, driver=RecordingCgroups(version=1), api_poll_interval=0.05, empty_grace=3600)
    agent.serve()
    return agent


def client(agent):
    return AgentClient(agent.config.socket_path, timeout=10)


def test_socket_is_private(agent):
    assert oct(os.stat(agent.config.socket_path).st_mode & 0o777) == "0o600"


def test_admit_list_attach_release(agent):
    c = client(agent)
    status, body = c.call("POST", "/v1/workloads", {"name": "web", "qos": "dedicated_cores", "cpus": 2})
    assert status == 201 and body["workload"]["cpus"] and body["workload"]["cgroup"] == "tidal/dedicated/web"
    assert agent.driver.exists("tidal/dedicated/web")
    status, body = c.call("POST", "/v1/workloads/web/attach", {"pid": os.getpid()})
    assert status == 200 and os.getpid() in agent.driver.procs("tidal/dedicated/web")
    names = [w["name"] for w in c.request("GET", "/v1/workloads")["workloads"]]
    assert names == ["web"]
    status, _ = c.call("DELETE", "/v1/workloads/web")
    assert status == 200 and not agent.driver.exists("tidal/dedicated/web")
    assert agent.store.load(TOPO).state.allocations == ()  # the checkpoint follows


@pytest.mark.parametrize("method,path,body,status,message", [
    ("POST", "/v1/workloads", {"name": "x", "qos": "gold_cores", "cpus": 1}, 400, "unknown qos"),
    ("POST", "/v1/workloads", {"name": "x", "qos": "dedicated_cores", "cpus": 0}, 400, "must be positive"),
    ("POST", "/v1/workloads", {"name": "x", "qos": "dedicated_cores", "cpus": 1.5}, 400, "whole cpus"),
    ("POST", "/v1/workloads", [1, 2], 400, "JSON object"),
    ("POST", "/v1/workloads", {"name": "x", "qos": "dedicated_cores", "cpus": 999}, 400, "asks 999 cpus"),
    ("DELETE", "/v1/workloads/ghost", None, 404, "no workload named 'ghost'"),
    ("POST", "/v1/workloads/ghost/attach", {"pid": 1}, 404, "no workload"),
    ("GET", "/v2/everything", None, 404, "no such path"),
], ids=["unknown-qos", "zero-cpus", "fractional", "not-object", "larger-than-node", "release-unknown",
        "attach-unknown", "bad-path"])
def test_bad_requests_are_4xx_json_and_change_nothing(agent, method, path, body, status, message):
    before = (agent.state, dict(agent.driver.files))
    got, data = client(agent).call(method, path, body)
    assert got == status and message in data["error"]
    assert (agent.state, dict(agent.driver.files)) == before


def test_malformed_body_and_name_in_use(agent):
    c = client(agent)
    import http.client
    import socket

    class Raw(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(agent.config.socket_path)

    conn = Raw("localhost")
    conn.request("POST", "/v1/workloads", body=b'{"name": ', headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 400 and "malformed JSON" in json.loads(response.read())["error"]
    c.request("POST", "/v1/workloads", {"name": "a", "qos": "shared_cores", "millicpu": 500})
    status, data = c.call("POST", "/v1/workloads", {"name": "a", "qos": "shared_cores", "millicpu": 500})
    assert status == 409 and "already in use" in data["error"]
    status, data = c.call("POST", "/v1/workloads/a/attach", {"pid": -4})
    assert status == 400 and "positive integer" in data["error"]
    status, data = c.call("POST", "/v1/workloads/a/attach", {"pid": 2 ** 22 + 12345})
    assert status in (200, 400)  # the recording driver accepts any pid; the kernel test covers ESRCH


def test_empty_workloads_are_released(make_agent):
    # a grace of 5 s (the test moves the clock past it); the API's watch off: the test ticks itself
    agent = make_agent(TOPO, api_poll_interval=0.05, empty_grace=5, watch_period=0, extra=("watch_period",))
    agent.admit({"name": "gone", "qos": "shared_cores", "millicpu": 100})
    agent.admit({"name": "young", "qos": "shared_cores", "millicpu": 100})
    agent.attach("gone", 4242)
    agent.tick()
    assert set(agent.state.names()) == {"gone", "young"}
    agent.driver.members["tidal/shared/gone"].clear()  # its process exited
    agent.tick()
    assert agent.state.names() == ["young"]  # never had a process, still within its grace
    agent.tick(now=agent.admission.created_at["young"] + 6)
    assert agent.state.names() == []
    assert agent.counters["released_empty"] == 2


def test_restart_reloads_state_and_reconciles(make_agent):
    driver = RecordingCgroups()
    first = make_agent(TOPO, driver=driver, api_poll_interval=0.05, empty_grace=3600)
    first.admit({"name": "web", "qos": "dedicated_cores", "cpus": 2})
    # the agent dies; someone narrows the workload's cpuset meanwhile
    driver.files["tidal/dedicated/web"][("cpuset", "cpuset.cpus")] = "7"
    second = make_agent(TOPO, driver=driver, api_poll_interval=0.05, empty_grace=3600)  # the same socket and state
    assert second.state == first.state
    from agent.topology.parse import format_cpulist
    assert driver.files["tidal/dedicated/web"][("cpuset", "cpuset.cpus")] == format_cpulist(first.state.get("web").cpus)


def test_cli_ps_status_release(agent):
    c = client(agent)
    c.request("POST", "/v1/workloads", {"name": "web", "qos": "dedicated_cores", "cpus": 2})
    c.request("POST", "/v1/workloads", {"name": "off", "qos": "reclaimed_cores", "millicpu": 500, "tier": "min"})
    runner = CliRunner()
    sock = agent.config.socket_path
    out = runner.invoke(main, ["ps", "--socket", sock])
    assert out.exit_code == 0 and "web" in out.output and "reclaimed_cores" in out.output
    data = json.loads(runner.invoke(main, ["ps", "--socket", sock, "--json"]).output)
    assert {w["name"]: w["tier"] for w in data} == {"web": None, "off": "min"}
    out = runner.invoke(main, ["status", "--socket", sock])
    assert out.exit_code == 0 and "dedicated  web" in out.output.replace("  ", "  ")
    status = json.loads(runner.invoke(main, ["status", "--socket", sock, "--json"]).output)
    owners = {c["id"]: (c["pool"], c["workload"]) for c in status["cpus"]}
    assert all(owners[cpu] == ("dedicated", "web") for cpu in agent.state.get("web").cpus)
    out = runner.invoke(main, ["release", "--socket", sock, "web"])
    assert out.exit_code == 0 and agent.state.get("web") is None
    out = runner.invoke(main, ["release", "--socket", sock, "web"])
    assert out.exit_code == 2 and "no workload named 'web'" in out.output


def test_cli_without_agent_is_one_clear_line(tmp_path):
    out = CliRunner().invoke(main, ["ps", "--socket", str(tmp_path / "none.sock")])
    assert out.exit_code == 2
    assert out.output.strip().startswith("tidal: error: no agent at") and len(out.output.strip().splitlines()) == 1


def test_tidal_run_execs_and_keeps_the_exit_status(agent):
    sock = agent.config.socket_path
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--socket", sock, "--qos", "shared_cores",
                           "--millicpu", "250", "--name", "job", "--", "sh", "-c", "echo hi; exit 3"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 3 and proc.stdout == "hi\n"
    moved = [op for op in agent.driver.ops if op[0] == "move" and op[1] == "tidal/shared/job"]
    assert len(moved) == 1
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--socket", sock, "--qos", "dedicated_cores",
                           "--cpus", "64", "--", "true"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "asks 64 cpus" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--socket", sock, "--name", "nocmd", "--",
                           "/no/such/binary"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 127 and "cannot run" in proc.stderr
    assert agent.state.get("nocmd") is None  # released again


def test_assignments_say_what_each_workload_is_given_without_reading_the_kernel(agent, monkeypatch):
    c = client(agent)
    c.request("POST", "/v1/workloads", {"name": "db", "qos": "dedicated_cores", "cpus": 2})
    c.request("POST", "/v1/workloads", {"name": "web", "qos": "shared_cores", "millicpu": 500})
    listed = {w["name"]: w for w in c.request("GET", "/v1/workloads")["workloads"]}
    # the NRI plugin asks this inside the runtime's deadline: no cgroup file is read to answer it
    monkeypatch.setattr(agent.driver, "procs", lambda path: (_ for _ in ()).throw(AssertionError("kernel read")))
    given = c.request("GET", "/v1/assignments")["assignments"]
    assert set(given) == {"db", "web"}
    for name in given:
        assert (given[name]["cpus"], given[name]["mems"]) == (listed[name]["cpus"], listed[name]["mems"])
    assert given["db"]["qos"] == "dedicated_cores" and given["web"]["cpu_shares"] == 512
    from agent.topology.parse import parse_cpulist
    assert not set(parse_cpulist(given["db"]["cpus"])) & set(parse_cpulist(given["web"]["cpus"]))

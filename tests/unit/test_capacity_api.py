"""Capacity API, long-poll, eviction tiers, lending and push, on an agent whose kernel writes are recorded."""

import json
import threading
import time

import pytest

from agent.client import AgentClient
from agent.reporter.usage import UsageSample
from agent.topology.synthetic import Shape, build_topology

TOPO = build_topology(Shape(sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=1))  # 8 cpus


class FakeSampler:
    """Usage as the test says: ``online`` millicpu of online work, ``offline`` of reclaimed work."""

    def __init__(self) -> None:
        self.online = 0
        self.offline = 0

    def sample(self, now, cgroups):
        per_cgroup = {"tidal/reclaimed": self.offline, "tidal/dedicated": 0}
        return UsageSample({}, per_cgroup, self.online + self.offline)

    def forget(self, keep):
        pass


def serving(make_agent, name="a", **overrides):
    """An agent whose usage is ``FakeSampler``'s, with a 2 s window, serving its API; agents of any name
    share one state directory (a second one is the first restarted)."""
    extra = tuple(k for k in overrides if k not in ("api_poll_interval", "empty_grace", "memory_reserved_bytes"))
    agent = make_agent(TOPO, name=name, state="state", api_poll_interval=0.05, empty_grace=3600,
                       memory_reserved_bytes=0, extra=extra, **overrides)
    agent.usage.sampler = FakeSampler()
    agent.harvest.estimator.window_s = 2.0
    agent.serve()
    return agent


@pytest.fixture()
def agent(tmp_path, make_agent):
    agent = serving(make_agent)
    yield agent
    agent.shutdown()


def get(agent, path):
    return AgentClient(agent.config.socket_path, timeout=15).call("GET", path)


def test_capacity_shapes(agent):
    status, doc = get(agent, "/v1/capacity")
    assert status == 200
    assert set(doc) >= {"node_state", "generation", "updated_at", "valid_seconds", "reclaimed"}
    assert doc["node_state"] == "Online" and doc["updated_at"].endswith("Z")
    reclaimed = doc["reclaimed"]
    assert reclaimed["millicpu"] == 8000  # nothing online yet: every cpu, reserved included, at idle priority
    assert [n["id"] for n in reclaimed["numa"]] == [0, 1] and sum(n["millicpu"] for n in reclaimed["numa"]) <= 8000
    status, yarn = get(agent, "/v1/capacity?format=yarn")
    assert yarn == {"resource": {"vCores": 8, "memory": reclaimed["memory_bytes"] // 2 ** 20}, "overCommitTimeout": -1}
    status, mesos = get(agent, "/v1/capacity?format=mesos")
    assert mesos["resources"][0] == {"name": "cpus", "type": "SCALAR", "scalar": {"value": 8.0}, "revocable": {}}
    assert mesos["resources"][1]["name"] == "mem"
    status, bare = get(agent, "/v1/capacity?format=mesos-array&revocable_cpus=2.5&revocable_mem_mb=1024")
    assert status == 200 and bare[0]["scalar"]["value"] == 5.5
    assert bare[1]["scalar"]["value"] == reclaimed["memory_bytes"] // 2 ** 20 - 1024


@pytest.mark.parametrize("query,message", [
    ("format=xml", "format must be"),
    ("wait_generation=abc", "must be an integer"),
    ("wait_generation=1&timeout=-1", "timeout within"),
    ("wait_generation=1&timeout=99999", "timeout within"),
    ("timeout=5", "goes with wait_generation"),
    ("colour=red", "unknown query parameter"),
    ("format=yarn&format=mesos", "given once"),
    ("format", "malformed query"),
    ("format=yarn&revocable_cpus=1", "go with format=mesos"),
    ("format=mesos&revocable_cpus=nan", "finite"),
    ("format=mesos-array&revocable_mem_mb=-5", ">= 0"),
    ("format=mesos&revocable_cpus=two", "must be numbers"),
], ids=["bad-format", "bad-generation", "negative-timeout", "huge-timeout", "timeout-alone", "unknown",
        "duplicate", "malformed", "revocable-not-mesos", "revocable-nan", "revocable-negative", "revocable-word"])
def test_bad_capacity_queries_are_400_and_the_agent_keeps_serving(agent, query, message):
    status, doc = get(agent, f"/v1/capacity?{query}")
    assert status == 400 and message in doc["error"], doc
    assert get(agent, "/v1/health") == (200, {"ok": True})


def test_long_poll_wakes_on_change_within_one_period(agent):
    status, doc = get(agent, "/v1/capacity")
    generation = doc["generation"]
    answer = {}

    def poll():
        start = time.monotonic()
        answer["status"], answer["doc"] = get(agent, f"/v1/capacity?wait_generation={generation}&timeout=20")
        answer["waited"] = time.monotonic() - start

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.3)
    assert poller.is_alive()  # nothing changed yet: still waiting
    agent.usage.sampler.online = 6000  # online load rises
    agent.tick(now=100.0)
    poller.join(timeout=10)
    assert answer["status"] == 200 and answer["doc"]["generation"] > generation
    assert answer["doc"]["reclaimed"]["millicpu"] == 0  # 8000 - 6000 x 1.2 < 1000: floored to 0
    assert answer["waited"] < 5


def test_long_poll_times_out_with_the_same_generation(agent):
    status, doc = get(agent, "/v1/capacity")
    status, again = get(agent, f"/v1/capacity?wait_generation={doc['generation']}&timeout=0.5")
    assert status == 200 and again["generation"] == doc["generation"]


def test_low_tier_is_evicted_before_min_and_high(tmp_path, make_agent):
    agent = serving(make_agent, eviction_grace=5)
    try:
        for name, tier in (("old-low", "low"), ("high", "high"), ("min", "min"), ("young-low", "low")):
            agent.admit({"name": name, "qos": "reclaimed_cores", "millicpu": 1500, "tier": tier})
            agent.attach(name, 10_000 + len(agent.state.allocations))
        agent.usage.sampler.online = 3000  # capacity -> 8000 - 3600 = 4400 -> 4000: 6000 asked
        agent.tick(now=10.0)
        assert agent.state.reclaim_millicpu == 4000
        assert len(agent.state.allocations) == 4  # throttled, not yet evicted
        agent.tick(now=16.0)
        evicted = [e["name"] for e in agent.eviction.evictions]
        assert evicted == ["young-low", "old-low"]  # low first, youngest first; then 3000 fits in 4000
        assert [a.name for a in agent.state.allocations] == ["high", "min"]
        kills = [op for op in agent.driver.ops if op[0] == "kill"]
        assert [op[1] for op in kills] == ["tidal/reclaimed/low/young-low", "tidal/reclaimed/low/old-low"]
        assert agent.eviction.by_tier == {"low": 2, "min": 0, "high": 0}
        agent.usage.sampler.online = 5000  # capacity -> 2000: min goes next, high stays
        agent.tick(now=20.0)
        agent.tick(now=26.0)
        assert [e["name"] for e in agent.eviction.evictions][2:] == ["min"]
        assert "reclaimed capacity fell to 2000 millicpu" in agent.eviction.evictions[-1]["reason"]
        assert agent.eviction.evictions[-1]["capacity_millicpu"] == 2000 and agent.eviction.evictions[-1]["cause"] == "cpu"
    finally:
        agent.shutdown()


def test_lending_round_trip_with_notice_and_a_restart_in_the_middle(tmp_path, make_agent):
    log = tmp_path / "hooks.log"
    hook = ["sh", "-c", f'echo "$TIDAL_NODE_FROM>$TIDAL_NODE_TO" >> {log}']
    hooks = {state: hook for state in ("OnlineToOffline", "Offline", "OfflineToOnline", "Online")}
    agent = serving(make_agent, hooks=hooks)
    client = AgentClient(agent.config.socket_path, timeout=15)
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 2000})
    node = client.request("POST", "/v1/node/lend", {"notice": "1s"})
    assert node["state"] == "OnlineToOffline" and node["deadline"]
    status, err = client.call("POST", "/v1/workloads", {"name": "new", "qos": "shared_cores", "millicpu": 100})
    assert status == 409 and "OnlineToOffline" in err["error"]
    agent.tick(now=1.0)
    assert agent.lending.current.state == "OnlineToOffline"  # online work still there: wait for it
    agent.release("web")
    agent.tick(now=2.0)
    assert agent.lending.current.state == "Offline"
    capacity = client.request("GET", "/v1/capacity")
    # lent: the whole machine less the reserved pool (cpu 0), whatever the usage estimate says
    assert capacity["node_state"] == "Offline" and capacity["reclaimed"]["millicpu"] == 7000
    agent.usage.sampler.online = 5000  # system work outside Tidal, busy: the lent machine is still offline's
    agent.tick(now=2.5)
    capacity = client.request("GET", "/v1/capacity")
    assert capacity["reclaimed"]["millicpu"] == 7000 and capacity["source"] == "lent"
    assert client.request("GET", "/v1/capacity?format=yarn")["resource"]["vCores"] == 7
    status, err = client.call("POST", "/v1/workloads", {"name": "web2", "qos": "dedicated_cores", "cpus": 1})
    assert status == 409 and "lent" in err["error"]
    agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 4000})
    agent.attach("batch", 4242)
    node = client.request("POST", "/v1/node/reclaim", {"notice": "2s"})
    assert node["state"] == "OfflineToOnline"
    capacity = client.request("GET", "/v1/capacity")
    assert capacity["target"] == {"millicpu": 0, "memory_bytes": 0} and capacity["deadline"]
    # every offline shape says the target at the start of the notice (YARN: its minimum allocation)
    assert client.request("GET", "/v1/capacity?format=yarn")["resource"] == {"vCores": 1, "memory": 1024}
    assert [r["scalar"]["value"] for r in client.request("GET", "/v1/capacity?format=mesos")["resources"]] == [0, 0]
    agent.shutdown()
    assert agent.lending.wait_hooks()  # the restart's hooks come after the first agent's
    # the agent restarts in the middle of the notice window
    again = serving(make_agent, name="b", hooks=hooks)
    try:
        assert again.lending.current.state == "OfflineToOnline"
        assert again.state.get("batch") is not None
        again.tick(now=1.0)
        assert again.lending.current.state == "OfflineToOnline"  # the notice is honoured across the restart
        time.sleep(max(0.0, again.lending.current.deadline - time.time()) + 0.05)
        again.tick(now=3.0)
        assert again.lending.current.state == "Online"
        assert again.state.get("batch") is None and again.eviction.evictions[-1]["name"] == "batch"
        assert "notice ended" in again.eviction.evictions[-1]["reason"]
        assert agent.lending.wait_hooks() and again.lending.wait_hooks()  # hooks run on a thread of their own
        assert log.read_text().split() == ["Online>OnlineToOffline", "OnlineToOffline>Offline",
                                           "Offline>OfflineToOnline", "OfflineToOnline>Online"]
    finally:
        again.shutdown()


@pytest.mark.parametrize("path,body,status,message", [
    ("/v1/node/lend", {"notice": "-5s"}, 400, "between 0 and 7 days"),
    ("/v1/node/lend", {"notice": "soon"}, 400, "duration"),
    ("/v1/node/lend", {"notice": "1s", "force": True}, 400, "unknown field"),
    ("/v1/node/reclaim", {"notice": "1s"}, 409, "not Offline"),
], ids=["negative-notice", "garbage-notice", "unknown-field", "reclaim-while-online"])
def test_bad_lending_requests(agent, path, body, status, message):
    got, data = AgentClient(agent.config.socket_path).call("POST", path, body)
    assert got == status and message in data["error"]
    assert agent.lending.current.state == "Online"


def test_push_to_an_unreachable_url_never_blocks_the_loop(tmp_path, make_agent):
    agent = serving(make_agent, push_url="http://127.0.0.1:9/capacity")
    try:
        agent.usage.sampler.online = 1000
        start = time.monotonic()
        for i in range(5):
            agent.tick(now=10.0 + i)
        assert time.monotonic() - start < 2.0
        deadline = time.monotonic() + 10
        while agent.pusher.failures < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert agent.pusher.failures >= 2 and agent.pusher.sent == 0  # retried, with backoff
        from click.testing import CliRunner

        from agent.cli import main

        out = CliRunner().invoke(main, ["status", "--socket", agent.config.socket_path]).output
        assert "push url http://127.0.0.1:9/capacity: sent 0" in out and "FAILING:" in out, out
        from agent.reporter.metrics import render

        text = render(agent).decode()
        assert 'tidal_push_failing{kind="url",target="http://127.0.0.1:9/capacity"} 1.0' in text, text
        assert 'tidal_push_sent_total{kind="url",target="http://127.0.0.1:9/capacity"} 0.0' in text
        assert get(agent, "/v1/health")[0] == 200
    finally:
        agent.shutdown()


def test_push_command_gets_the_yarn_body(tmp_path, make_agent):
    out = tmp_path / "pushed.json"
    agent = serving(make_agent, push_command=["sh", "-c", f'cat > {out}; echo "$TIDAL_VCORES" >> {out}.env'])
    try:
        agent.usage.sampler.online = 2000
        agent.tick(now=5.0)
        deadline = time.monotonic() + 10
        while agent.pusher.sent < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        body = json.loads(out.read_text())
        assert body == {"resource": {"vCores": agent.harvest.capacity.millicpu // 1000,
                                     "memory": agent.harvest.capacity.memory_bytes // 2 ** 20}, "overCommitTimeout": -1}
        assert (tmp_path / "pushed.json.env").read_text().split()[-1] == str(body["resource"]["vCores"])
        from click.testing import CliRunner

        from agent.cli import main

        out = CliRunner().invoke(main, ["status", "--socket", agent.config.socket_path]).output
        assert f"push command sh: sent 1, failures 0, last sent {body['resource']['vCores']} vcores" in out, out
    finally:
        agent.shutdown()


def test_metrics(agent):
    agent.admit({"name": "web", "qos": "dedicated_cores", "cpus": 2})
    import http.client
    import socket

    class Raw(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(agent.config.socket_path)

    raw = Raw("localhost")
    raw.request("GET", "/metrics")
    response = raw.getresponse()
    text = response.read().decode()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    assert 'tidal_pool_cpus{numa="0",pool="dedicated"} 2.0' in text
    assert "tidal_reclaimed_capacity_millicpu" in text and 'tidal_evictions_total{tier="low"} 0.0' in text
    assert 'tidal_node_state{state="Online"} 1.0' in text and "tidal_reconcile_duration_seconds" in text
    assert 'tidal_workload_request_millicpu{qos="dedicated_cores",workload="web"} 2000.0' in text


def test_cli_capacity_and_node(agent):
    from click.testing import CliRunner

    from agent.cli import main

    runner = CliRunner()
    sock = agent.config.socket_path
    out = runner.invoke(main, ["capacity", "--socket", sock, "--format", "yarn"])
    assert out.exit_code == 0 and json.loads(out.output) == {"resource": {"vCores": 8, "memory": agent.harvest.capacity.memory_bytes // 2 ** 20},
                                                           "overCommitTimeout": -1}
    out = runner.invoke(main, ["capacity", "--socket", sock])
    assert out.exit_code == 0 and "Online  reclaimed 8 cpus" in out.output
    out = runner.invoke(main, ["node", "lend", "--socket", sock, "--notice", "-1s"])
    assert out.exit_code == 2 and "between 0 and 7 days" in out.output
    out = runner.invoke(main, ["node", "lend", "--socket", sock, "--notice", "30s", "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["state"] == "Offline"  # nothing online to wait for
    out = runner.invoke(main, ["node", "status", "--socket", sock])
    assert out.exit_code == 0 and out.output.startswith("Offline since ")
    out = runner.invoke(main, ["node", "lend", "--socket", sock])
    assert out.exit_code == 2 and "cannot lend: the node is Offline" in out.output


def test_a_slow_hook_never_holds_the_agent(tmp_path, make_agent):
    """#17: a 20 s hook froze /v1/status, the loop and the guard for 19.5 s: hooks ran under the lock."""
    hooks = {"OnlineToOffline": ["sleep", "3"]}
    agent = serving(make_agent, hooks=hooks)
    client = AgentClient(agent.config.socket_path, timeout=15)
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 500})  # keeps the node in its notice
    try:
        start = time.monotonic()
        assert client.request("POST", "/v1/node/lend", {"notice": "60s"})["state"] == "OnlineToOffline"
        client.request("GET", "/v1/status")
        agent.tick()
        assert time.monotonic() - start < 1.5  # the lend, a status and a period, while the hook sleeps
        assert agent.lending.wait_hooks(timeout=10)
        assert agent.lending.hook_results[-1] == {"state": "OnlineToOffline", "argv": ["sleep", "3"], "exit": 0}
    finally:
        agent.shutdown()

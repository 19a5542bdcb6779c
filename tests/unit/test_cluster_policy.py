"""The cluster policy's rules (agent/k8s/policy.py, agent/tunables.py) without an API server: which policy
a node follows, what a policy may set, the precedence of the node's own settings, and loops turned off
by a policy letting go at once. The API server and the agent process: tests/k8s/test_policy.py."""

from __future__ import annotations

import threading

import pytest

from agent.k8s.policy import PolicyWatcher, choose, selects
from agent.tunables import TUNABLES, from_policy, resolve

MIB = 1 << 20


def obj(name, selector=None, priority=None, generation=1, **agent):
    spec = {"agent": agent}
    if selector is not None:
        spec["nodeSelector"] = selector
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name, "generation": generation}, "spec": spec}


@pytest.mark.parametrize("selector, labels, expected", [
    (None, {}, True),
    ({}, {"a": "1"}, True),
    ({"matchLabels": {"pool": "batch"}}, {"pool": "batch", "x": "y"}, True),
    ({"matchLabels": {"pool": "batch"}}, {"pool": "web"}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}, {"zone": "b"}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}, {}, False),
    ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}, {}, True),
    ({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}, {"zone": "a"}, False),
    ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
    ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": ""}, False),
    ({"matchExpressions": [{"key": "gpu", "operator": "Gt", "values": ["1"]}]}, {"gpu": "2"}, False),
    ("not a selector", {}, False),
])
def test_label_selectors_select_as_kubernetes_does(selector, labels, expected):
    assert selects(selector, labels) is expected


def test_a_node_follows_the_matching_policy_of_highest_priority_then_the_first_by_name():
    policies = [obj("b-batch", {"matchLabels": {"pool": "batch"}}), obj("a-batch", {"matchLabels": {"pool": "batch"}}),
                obj("all", priority=-1), obj("gpu", {"matchLabels": {"gpu": "yes"}}, priority=5)]
    assert choose(policies, {"pool": "batch"})["metadata"]["name"] == "a-batch"
    assert choose(policies, {"pool": "batch", "gpu": "yes"})["metadata"]["name"] == "gpu"
    assert choose(policies, {"pool": "web"})["metadata"]["name"] == "all"
    assert choose(policies[:2], {"pool": "web"}) is None


def test_a_policy_sets_only_known_settings_with_valid_values():
    values, refused = from_policy({"memoryPressureThreshold": 35, "memoryEvictBelow": "1Gi", "lendingNotice": "2m",
                                   "cpuPressureThreshold": 101, "evictionGrace": "soon", "reclaimBufer": 0.3})
    assert values == {"memory-pressure-threshold": 35.0, "memory-evict-below": 1 << 30, "lending-notice": 120.0}
    assert refused == {"cpuPressureThreshold": "101 is not within 0 to 100 percent",
                       "evictionGrace": "a number of seconds, got 'soon'",
                       "reclaimBufer": "not a setting this agent has"}
    assert from_policy(None) == ({}, {}) and from_policy([1]) == ({}, {"agent": "not an object"})
    # every tunable is a flag of the agent and a field of the CRD
    import yaml

    from agent.cli import agent as command
    from agent.configfile import options

    crd = yaml.safe_load(open("deploy/crd-tidalpolicy.yaml"))
    fields = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["agent"]
    assert {t.field for t in TUNABLES} == set(fields["properties"])
    assert {t.key for t in TUNABLES} <= set(options(command))


def test_the_nodes_own_settings_come_before_the_policy_which_comes_before_the_defaults():
    from agent.daemon import AgentConfig

    config = AgentConfig(cpu_pressure_threshold=30.0)
    out = resolve(config, {"cpu-pressure-threshold"}, {"cpu-pressure-threshold": 5.0, "eviction-grace": 30.0})
    assert out["cpu-pressure-threshold"] == (30.0, "local")
    assert out["eviction-grace"] == (30.0, "policy")
    assert out["memory-pressure-threshold"] == (20.0, "default")


def test_a_loop_a_policy_turns_off_lets_go_at_once(make_agent):
    from agent.isolation.cgroups.blockio import read_io_limits
    from agent.isolation.cgroups.recording import RecordingCgroups
    from tests.unit.test_capacity_api import TOPO

    driver = RecordingCgroups(version=2, features={"cpu.idle": True, "memory": True, "io": True})
    agent = make_agent(TOPO, driver=driver, memory_reserved_bytes=0)
    try:
        agent.harvest.io_guard.throttle.limits = {"254:0": (4 * MIB, None)}
        agent.harvest.throttle.limit = 512 * MIB
        agent.reconcile()
        assert read_io_limits(driver, "tidal/reclaimed") == {"254:0": (4 * MIB, None)}
        changed = agent.apply_policy({"name": "quiet", "generation": 4,
                                      "agent": {"ioPressureThreshold": 0, "memoryPressureThreshold": 0}})
        assert changed == {"io-pressure-threshold": 0.0, "memory-pressure-threshold": 0.0}
        assert read_io_limits(driver, "tidal/reclaimed") == {}  # written at once, not at the next period
        assert agent.harvest.throttle.limit is None and agent.eviction.memory_pressure_threshold == 0.0
        assert agent.status()["policy"] == {"name": "quiet", "generation": 4, "kept_local": [], "refused": {},
                                            "applied": ["io-pressure-threshold", "memory-pressure-threshold"]}
        agent.apply_policy(None)
        assert agent.status()["policy"] is None and agent.harvest.io_guard.throttle.threshold == 20.0
    finally:
        agent.shutdown()


def test_the_watcher_applies_on_events_and_labels_in_order():
    applied = []

    class FakeAgent:  # the watcher's one call into the agent
        def apply_policy(self, doc):
            applied.append(None if doc is None else (doc["name"], doc["generation"], doc["agent"]))
            return {}

    watcher = PolicyWatcher(FakeAgent(), rest=None, stop=threading.Event())
    watcher._on_list([obj("batch", {"matchLabels": {"pool": "batch"}}, memoryPressureThreshold=35)])
    assert applied == []  # the node's labels are not known yet
    watcher.node_labels({"pool": "batch"})
    watcher.node_labels({"pool": "batch"})  # the same labels: nothing again
    watcher._on_event("MODIFIED", obj("batch", {"matchLabels": {"pool": "batch"}}, generation=2,
                                      memoryPressureThreshold=40))
    watcher._on_event("ADDED", obj("other", {"matchLabels": {"pool": "web"}}))  # not this node's: nothing
    watcher.node_labels({"pool": "web"})
    watcher._on_event("DELETED", obj("other"))
    assert applied == [("batch", 1, {"memoryPressureThreshold": 35}), ("batch", 2, {"memoryPressureThreshold": 40}),
                       ("other", 1, {}), None]

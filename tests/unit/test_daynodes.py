"""``cluster.daynodes``: the stand-in for the agents of a compressed day's KWOK nodes and the offline jobs as
pods, against a recording API (the day itself runs on a real control plane: tests/k8s/test_day.py)."""

import pytest

from cluster.daynodes import NodeStandIn, OfflineJobs
from cluster.simulate import Job
from contracts.states import CURRENT_ANNOTATION, OFFLINE, ONLINE, RECLAIMED_CPU, TO_OFFLINE, TO_ONLINE


class Api:
    """Records writes; ``pods`` is what a list would return."""

    def __init__(self):
        self.calls = []
        self.pods = {}

    def json(self, method, path, body=None, ok=(200, 201), content_type=None):
        self.calls.append((method, path, body))
        if method == "POST" and path.endswith("/pods"):
            self.pods[body["metadata"]["name"]] = {"metadata": dict(body["metadata"]), "spec": dict(body["spec"]),
                                                  "status": {}}
        elif method == "DELETE":
            self.pods.pop(path.rsplit("/", 1)[1], None)
        return {}

    def bind(self, name, node):
        self.pods[name]["spec"]["nodeName"] = node

    def listed(self):
        return list(self.pods.values())


def test_a_node_follows_its_label_through_its_notices_and_a_take_back_calls_off_a_lending():
    nodes = NodeStandIn(Api(), ["a", "b"], cores=15, notice=5)
    assert nodes.follow(0, {"a": OFFLINE}) == [] and nodes.state("a") == TO_OFFLINE and nodes.state("b") == ONLINE
    nodes.follow(4, {"a": OFFLINE})
    assert nodes.state("a") == TO_OFFLINE
    nodes.follow(5, {"a": OFFLINE})
    assert nodes.state("a") == OFFLINE
    assert nodes.follow(10, {"a": ONLINE}) == [] and nodes.state("a") == TO_ONLINE
    nodes.follow(12, {"a": OFFLINE})  # lent again during the take-back: the take-back finishes first
    assert nodes.state("a") == TO_ONLINE
    assert nodes.follow(15, {"a": ONLINE}) == ["a"] and nodes.state("a") == ONLINE
    nodes.follow(20, {"b": OFFLINE})
    nodes.follow(21, {"b": ONLINE})  # called off during its lending notice: online at once
    assert nodes.state("b") == ONLINE


def test_capacity_is_the_headroom_rules_on_an_online_node_and_all_but_the_reserve_on_a_lent_one():
    nodes = NodeStandIn(Api(), ["a", "b"], cores=15, reserve=1.0, notice=0, window=3, buffer=0.2)
    nodes.follow(0, {"b": OFFLINE})
    first = nodes.capacity({"a": 10.0}, 0.5)
    # a: nothing seen yet, peak 0; b: lent
    assert first == {"a": 14000, "b": 14000}
    second = nodes.capacity({"a": 10.0}, 0.5)
    assert second["a"] == int((15 - 1 - 0.5 * 10 * 1.2) * 1000)  # its peak use per requested core, x 1.2
    nodes.capacity({"a": 10.0}, 0.2)
    nodes.capacity({"a": 10.0}, 0.2)
    assert nodes.capacity({"a": 10.0}, 0.2)["a"] == int((14 - 0.5 * 12) * 1000)  # 0.5 still in the window
    assert nodes.capacity({"a": 10.0}, 0.2)["a"] == int((14 - 0.2 * 12) * 1000)  # out of it now
    # b comes back: no use of its own yet, its requests stand in whole
    nodes.follow(1, {"b": ONLINE})
    assert nodes.capacity({"a": 10.0, "b": 6.0}, 0.2)["b"] == int((14 - 6 * 1.2) * 1000)


def test_the_stand_in_publishes_whole_cores_and_its_state_only_when_they_change():
    api = Api()
    nodes = NodeStandIn(api, ["a"], cores=15, notice=5)
    assert nodes.publish({"a": 7600}) == 2  # the figure and the state annotation
    method, path, body = api.calls[0]
    assert path == "/api/v1/nodes/a/status" and body["status"]["allocatable"] == {RECLAIMED_CPU: "7000m"}
    assert api.calls[1][2]["metadata"]["annotations"] == {CURRENT_ANNOTATION: ONLINE}
    assert nodes.publish({"a": 7900}) == 0  # still 7 whole cores
    nodes.follow(0, {"a": OFFLINE})
    assert nodes.publish({"a": 7900}) == 1 and api.calls[-1][2]["metadata"]["annotations"][CURRENT_ANNOTATION] == TO_OFFLINE


def jobs_of(*specs):
    return [Job(arrival, f"j{i}", cores, minutes, tier) for i, (arrival, cores, minutes, tier) in enumerate(specs)]


def test_jobs_arrive_as_reclaimed_pods_for_tidals_scheduler_that_tolerate_a_lent_nodes_cordon():
    api = Api()
    jobs = OfflineJobs(api, "day", jobs_of((0, 2, 3, "high"), (2, 4, 1, "low")))
    assert jobs.arrive(0) == 1 and jobs.arrive(1) == 0 and jobs.arrive(2) == 1
    pod = api.pods["job-0-0"]
    assert pod["spec"]["schedulerName"] == "tidal-scheduler"
    assert pod["spec"]["containers"][0]["resources"]["requests"] == {RECLAIMED_CPU: "2000m"}
    assert pod["metadata"]["annotations"]["tidal.io/tier"] == "high"
    assert {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["spec"]["tolerations"]


def test_a_traces_pinned_job_asks_for_its_node_and_one_bound_elsewhere_is_said():
    api = Api()
    pinned = [Job(0, "a", 2, 10, "high", 1), Job(0, "b", 2, 10, "low", None)]
    jobs = OfflineJobs(api, "day", pinned, node_names=["n0", "n1"])
    jobs.arrive(0)
    assert api.pods["job-0-0"]["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n1"}
    assert "nodeSelector" not in api.pods["job-1-0"]["spec"]
    api.bind("job-0-0", "n0")  # a scheduler that ignored the selector
    api.bind("job-1-0", "n0")
    jobs.observe(0, api.listed(), {})
    assert jobs.summary()["pinned_jobs"] == 1 and jobs.summary()["pinned_elsewhere"] == ["job-0-0 on n0"]
    with pytest.raises(ValueError):
        OfflineJobs(Api(), "day", [Job(0, "c", 1, 1, "low", 5)], node_names=["n0"]).arrive(0)


def test_a_job_runs_its_minutes_once_bound_and_is_done():
    api = Api()
    jobs = OfflineJobs(api, "day", jobs_of((0, 2, 2.5, "min")))
    jobs.arrive(0)
    jobs.observe(0, api.listed(), {})
    assert jobs.run_minute(0) == {}  # not bound yet: it waits, and counts nothing
    api.bind("job-0-0", "n1")
    for minute in (1, 2):
        jobs.observe(minute, api.listed(), {})
        assert jobs.run_minute(minute) == {"n1": 2}
    jobs.observe(3, api.listed(), {})
    assert jobs.run_minute(3) == {"n1": 2}  # 2.5 minutes: a third minute, then done
    assert "job-0-0" not in api.pods and jobs.completed["min"] == 1 and jobs.core_minutes == 6


def test_evictions_go_by_tier_then_youngest_and_the_job_runs_again_its_work_lost():
    api = Api()
    jobs = OfflineJobs(api, "day", jobs_of((0, 4, 60, "high"), (0, 4, 60, "low"), (0, 4, 60, "low")))
    jobs.arrive(0)
    api.bind("job-0-0", "n1")
    api.bind("job-1-0", "n1")
    jobs.observe(0, api.listed(), {})
    api.bind("job-2-0", "n1")
    jobs.observe(1, api.listed(), {})
    said = jobs.evict(5, {"n1": 8000}, notice_ended=[])
    assert said == ["5: n1 evicts 1 offline pod(s) (cpu)"]
    assert "job-2-0" not in api.pods and "job-1-0" in api.pods  # low tier, the younger of the two
    assert jobs.evicted["cpu"]["low"] == 1 and jobs.lost_core_minutes == 4 * 4 and jobs.evicted_fresh == 0
    jobs.evict(6, {"n1": 3000}, notice_ended=["n1"])  # a take-back notice ended: what stays must fit
    assert set(api.pods) == set() and jobs.evicted["lending"] == {"high": 1, "min": 0, "low": 1}
    assert jobs.arrive(7) == 3 and {"job-0-1", "job-1-1", "job-2-1"} <= set(api.pods)


def test_a_pod_gone_without_its_agents_word_is_killed_outside_a_notice_and_runs_again():
    api = Api()
    jobs = OfflineJobs(api, "day", jobs_of((0, 2, 60, "low")))
    jobs.arrive(0)
    api.bind("job-0-0", "n1")
    jobs.observe(0, api.listed(), {"n1": OFFLINE})
    del api.pods["job-0-0"]  # someone else deleted it
    jobs.observe(3, api.listed(), {"n1": OFFLINE})
    assert jobs.killed_outside_notice == ["3: job-0-0 on n1 (Offline)"] and jobs.lost_core_minutes == 6
    assert jobs.summary()["killed_outside_notice"] == 1
    assert jobs.arrive(4) == 1 and "job-0-1" in api.pods
    # a pod being deleted (its deletionTimestamp set by someone else) is gone the same
    api.bind("job-0-1", "n1")
    jobs.observe(5, api.listed(), {})
    api.pods["job-0-1"]["metadata"]["deletionTimestamp"] = "2026-11-28T00:00:00Z"
    jobs.observe(6, api.listed(), {})
    assert len(jobs.killed_outside_notice) == 2


def test_the_eviction_order_is_the_agents():
    """The stand-in calls the agents' rule (contracts.eviction) on pods, the agent on its allocations: the
    same pods go for the same capacity."""
    from agent.qrm.eviction import choose_victims as agents
    from agent.qrm.model import Allocation, QoS, Tier
    from contracts.eviction import choose_victims

    pods = [("a", "high", 4000), ("b", "low", 2000), ("c", "min", 3000), ("d", "low", 1000), ("e", "high", 2000)]
    expected = {0: "d b c e a", 3000: "d b c e a", 6000: "d b c", 9000: "d b", 11500: "d", 12000: ""}
    for capacity, names in expected.items():
        theirs = agents([Allocation(n, QoS.RECLAIMED, m, tier=Tier(t)) for n, t, m in pods], capacity)
        ours = choose_victims(pods, capacity, tier=lambda p: p[1], millicpu=lambda p: p[2])
        assert [v[0] for v in ours] == [a.name for a in theirs] == names.split(), capacity

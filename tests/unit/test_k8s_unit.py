"""The Kubernetes pieces without a cluster: annotations, kubelet cgroup paths, NRT, the extender's verbs."""

import copy
import json
from pathlib import Path

import pytest

from agent.isolation.cgroups.recording import RecordingCgroups
from agent.k8s.node import KubeletLayout, KubeNodeAgent
from contracts.pods import pod_request, qos_class, quantity
from agent.qrm.policy import allocate, initial_state, pools
from agent.errors import AdmissionError
from agent.qrm.requests import parse_request
from agent.reporter.nrt import build_nrt
from contracts.nrt import decode as to_report
from cluster.extender import TopologyCache, pod_spec

FIXTURES = Path(__file__).parent.parent / "fixtures" / "extender"
GIB = 1 << 30


def pod(name="p", cpu="2", memory="1Gi", limits=True, annotations=None, extra=None, uid="0f1e-22"):
    resources = {"requests": {"cpu": cpu, "memory": memory, **(extra or {})}}
    if limits:
        resources["limits"] = dict(resources["requests"])
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "c", "resources": resources}]}}


@pytest.mark.parametrize("text, value", [("500m", 0.5), ("2", 2), ("4Gi", 4 * GIB), ("1.5", 1.5), ("1k", 1000)],
                         ids=["milli", "whole", "gibi", "fraction", "kilo"])
def test_quantities(text, value):
    assert quantity(text) == value


@pytest.mark.parametrize("spec, want", [
    (pod(cpu="4"), {"qos": "dedicated_cores", "cpus": 4}),
    (pod(cpu="1500m"), {"qos": "shared_cores", "millicpu": 1500}),
    (pod(cpu="500m", limits=False), {"qos": "shared_cores", "millicpu": 500}),
    (pod(cpu="4", annotations={"tidal.io/numa-binding": "true"}), {"qos": "dedicated_cores", "cpus": 4,
                                                                    "numa_binding": True}),
    (pod(cpu="4", annotations={"katalyst.kubewharf.io/qos_level": "dedicated_cores",
                               "katalyst.kubewharf.io/memory_enhancement": '{"numa_binding": "true"}'}),
     {"qos": "dedicated_cores", "cpus": 4, "numa_binding": True}),
    (pod(cpu="100m", limits=False, extra={"tidal.io/reclaimed-millicpu": "2000"},
         annotations={"tidal.io/tier": "high"}), {"qos": "reclaimed_cores", "millicpu": 2000, "tier": "high"}),
    (pod(cpu="4", annotations={"tidal.io/qos-level": "shared_cores"}), {"qos": "shared_cores", "millicpu": 4000}),
], ids=["guaranteed-whole", "guaranteed-fraction", "burstable", "numa-annotation", "katalyst-aliases",
        "reclaimed-resource", "level-overrides-default"])
def test_pod_annotations_and_defaults(spec, want):
    request = pod_request(spec)
    assert request.problem is None
    doc = dict(request.document)
    assert doc.pop("name") == "pod/0f1e-22" and doc.pop("label") == "ns/p"  # by uid; the name for people
    assert doc == want
    parse_request(request.document, pod=True)  # the agent accepts it from the pod source
    with pytest.raises(AdmissionError, match="must match"):
        parse_request(request.document)  # and from no other: the local API cannot take a pod's name


def test_a_static_pod_is_known_by_the_kubelets_uid_not_its_mirrors():
    spec = pod(cpu="2", annotations={"kubernetes.io/config.mirror": "9c1f5e0d2b"}, uid="mirror-uid")
    request = pod_request(spec)
    assert request.workload == "pod/9c1f5e0d2b" and request.uid == "9c1f5e0d2b"
    assert KubeletLayout(RecordingCgroups(), "cgroupfs").paths(spec, request)[0] == "kubepods/pod9c1f5e0d2b"


def test_two_pods_with_a_long_common_prefix_never_share_a_workload():
    long = "x" * 200
    a, b = pod(name=long + "a", uid="uid-a"), pod(name=long + "b", uid="uid-b")
    assert pod_request(a).workload != pod_request(b).workload


@pytest.mark.parametrize("annotations, problem", [
    ({"tidal.io/qos-level": "turbo"}, "unknown level 'turbo'"),
    ({"tidal.io/numa-binding": "maybe"}, "expected \"true\" or \"false\""),
    ({"katalyst.kubewharf.io/memory_enhancement": "{numa"}, "not JSON"),
    ({"tidal.io/tier": "gold"}, "unknown tier 'gold'"),
], ids=["level", "flag", "katalyst-json", "tier"])
def test_malformed_annotations_fall_back_to_the_default_with_a_reason(annotations, problem):
    request = pod_request(pod(cpu="4", annotations=annotations))
    assert problem in request.problem and "default treatment" in request.problem
    assert request.document["qos"] == "dedicated_cores"  # Guaranteed with whole cpus: the default


def test_qos_class_is_computed_when_the_status_does_not_say():
    assert qos_class(pod(cpu="1")) == "Guaranteed"
    assert qos_class(pod(cpu="1", limits=False)) == "Burstable"
    assert qos_class({"spec": {"containers": [{"name": "c"}]}}) == "BestEffort"
    assert qos_class({"status": {"qosClass": "Burstable"}, "spec": {}}) == "Burstable"


def pod_agent(topo, make_agent, cgroups):
    """An agent as ``tidal agent --kube-node`` builds it (defaults, no reserved pool), on a recording driver;
    each call of a test on the same state directory is a restart."""
    return make_agent(topo, driver=cgroups, state="state", reserved_cpus=())


@pytest.mark.parametrize("driver, qos, runtime_id, want_pod, want_container", [
    ("cgroupfs", "Burstable", "containerd://abc", "kubepods/burstable/pod0f1e-22", "kubepods/burstable/pod0f1e-22/abc"),
    ("cgroupfs", "Guaranteed", "containerd://abc", "kubepods/pod0f1e-22", "kubepods/pod0f1e-22/abc"),
    ("systemd", "Burstable", "containerd://abc", "kubepods.slice/kubepods-burstable.slice/"
     "kubepods-burstable-pod0f1e_22.slice", "kubepods.slice/kubepods-burstable.slice/"
     "kubepods-burstable-pod0f1e_22.slice/cri-containerd-abc.scope"),
    ("systemd", "Guaranteed", "cri-o://def", "kubepods.slice/kubepods-pod0f1e_22.slice",
     "kubepods.slice/kubepods-pod0f1e_22.slice/crio-def.scope"),
], ids=["cgroupfs-burstable", "cgroupfs-guaranteed", "systemd-containerd", "systemd-crio"])
def test_allocations_are_written_to_the_kubelet_cgroups(topo_dual_socket_ht, tmp_path, driver, qos, runtime_id, want_pod, want_container, make_agent):
    cgroups = RecordingCgroups()
    cgroups.create("kubepods.slice" if driver == "systemd" else "kubepods")
    for path in (want_pod, want_container):
        cgroups.create(path)
    layout = KubeletLayout(cgroups)
    assert layout.driver == driver  # detected from the tree
    spec = pod(cpu="2" if qos == "Guaranteed" else "500m", limits=qos == "Guaranteed")
    spec["status"] = {"qosClass": qos, "containerStatuses": [{"name": "c", "containerID": runtime_id}]}
    request = pod_request(spec)
    agent = pod_agent(topo_dual_socket_ht, make_agent, cgroups)
    agent.admit(request.document, source="kubernetes")
    assert layout.paths(spec, request) == (want_pod, want_container)
    agent.place(request.workload, layout.paths(spec, request))
    described = agent.workloads()[0]
    assert described["cgroups"] == [want_pod, want_container] and described["source"] == "kubernetes"
    for path in (want_pod, want_container):  # written by the agent's one Reconciler
        assert cgroups.files[path][("cpuset", "cpuset.cpus")] == described["cpus"]
        assert cgroups.files[path][("cpuset", "cpuset.mems")] == described["mems"]
    assert not cgroups.exists(f"tidal/{'dedicated' if qos == 'Guaranteed' else 'shared'}/{request.workload}")


def test_a_pod_cgroup_the_kubelet_has_not_made_yet_is_written_once_it_is_there(topo_dual_socket_ht, tmp_path, make_agent):
    cgroups = RecordingCgroups()
    cgroups.create("kubepods")
    cgroups.create("kubepods/burstable")
    request = pod_request(pod(cpu="500m", limits=False))
    agent = pod_agent(topo_dual_socket_ht, make_agent, cgroups)
    agent.admit(request.document, source="kubernetes")
    path = "kubepods/burstable/pod0f1e-22"
    agent.place(request.workload, (path,))
    assert not [op for op in cgroups.ops if op[0] in ("write", "create") and op[1].startswith(path)]
    cgroups.create(path)  # the kubelet starts the pod
    agent.tick()  # one period
    assert cgroups.files[path][("cpuset", "cpuset.cpus")] == agent.workloads()[0]["cpus"]
    assert "tidal/shared/ns.p" not in cgroups.files  # its processes are not in Tidal's tree


def test_a_pod_is_kept_while_its_processes_are_in_the_kubelets_cgroups_and_tidals_are_empty(topo_dual_socket_ht, tmp_path, make_agent):
    """The defect of #16: the 'empty cgroup' rule of local workloads released pods after 30 s."""
    cgroups = RecordingCgroups()
    agent = pod_agent(topo_dual_socket_ht, make_agent, cgroups)
    assert agent.config.empty_grace == 30 and agent.config.watch_period == 10  # the shipped settings
    request = pod_request(pod(cpu="2"))
    agent.admit(request.document, source="kubernetes")
    agent.admit({"name": "local", "qos": "shared_cores", "millicpu": 100})
    start = agent.admission.created_at["local"]
    for second in range(0, 121, 5):  # two minutes of periods, with nobody's processes in Tidal's tree
        agent.tick(now=start + second)
    assert agent.state.names() == [request.workload]  # the local workload's empty cgroup released it; not the pod
    assert agent.state.get(request.workload).source == "kubernetes"


class FakeRest:
    """``kube.rest.Rest`` as the node agent calls it: each call recorded (method, path, body, content type),
    answered with ``answers[(method, path)]`` (a dict, or an exception to raise), else ``{}``."""

    def __init__(self, answers=None):
        self.calls, self.answers = [], dict(answers or {})
        self.host, self.port = "fake", 0

    def json(self, method, path, body=None, ok=(200, 201), content_type=None):
        self.calls.append((method, path, body, content_type))
        answer = self.answers.get((method, path), {})
        if isinstance(answer, Exception):
            raise answer
        return answer


_NoApi = FakeRest  # the node agent's API, not called where ``on_pod`` and relisting are what is tested


def test_a_restarted_node_agent_adopts_its_pods_and_releases_only_unclaimed_ones(topo_dual_socket_ht, tmp_path, make_agent):
    cgroups = RecordingCgroups()
    agent = pod_agent(topo_dual_socket_ht, make_agent, cgroups)
    kept, gone = pod(name="kept", cpu="2", uid="u-kept"), pod(name="gone", cpu="2", uid="u-gone")
    for spec in (kept, gone):
        agent.admit(pod_request(spec).document, source="kubernetes")
    agent.admit({"name": "local", "qos": "shared_cores", "millicpu": 100})
    cpus = agent.state.get("pod/u-kept").cpus
    agent.shutdown()
    # the restart: a new agent from the same state dir, a new node agent that lists pods
    again = pod_agent(topo_dual_socket_ht, make_agent, RecordingCgroups())
    assert set(again.state.names()) == {"pod/u-kept", "pod/u-gone", "local"}
    node = KubeNodeAgent(again, _NoApi(), "n1")
    node.on_pod(kept)  # listed: adopted, not admitted again (which would refuse the name)
    assert node.pods["u-kept"].workload == "pod/u-kept" and not node.refused
    with node.lock:
        node._release_unclaimed()  # after the first full list
    assert set(again.state.names()) == {"pod/u-kept", "local"}
    assert again.state.get("pod/u-kept").cpus == cpus


def test_an_older_agents_pod_names_are_adopted_with_their_cpus(topo_dual_socket_ht, tmp_path, make_agent):
    """Agents before 0.2 named pods <namespace>.<name>: the upgraded agent renames them when it lists the pod."""
    from agent.qrm.model import Allocation, QoS
    from agent.qrm.state import CheckpointStore

    topo = topo_dual_socket_ht
    state = initial_state(topo, None)
    state = state.with_allocation(Allocation("ns.kept", QoS.DEDICATED, 2000, cpus=(4, 5), mems=(0, 1, 2, 3),
                                             source="kubernetes"))
    state = state.with_allocation(Allocation("ns.gone", QoS.SHARED, 500, mems=(0, 1, 2, 3), source="kubernetes"))
    (tmp_path / "state").mkdir()
    CheckpointStore(str(tmp_path / "state" / "checkpoint.json")).save(state, topo)
    agent = pod_agent(topo, make_agent, RecordingCgroups())
    assert set(agent.state.names()) == {"ns.kept", "ns.gone"}  # the checkpoint of 0.1 is read as it is
    node = KubeNodeAgent(agent, _NoApi(), "n1")
    node.on_pod(pod(name="kept", cpu="2", uid="u-kept"))
    with node.lock:
        node._release_unclaimed()
    assert agent.state.names() == ["pod/u-kept"] and not node.refused
    kept = agent.state.get("pod/u-kept")
    assert kept.cpus == (4, 5) and kept.label == "ns/kept"


def test_nrt_zones_track_dedicated_numa_bound_workloads(topo_dual_socket_ht):
    topo = topo_dual_socket_ht
    state = initial_state(topo, ())
    decision = allocate(topo, state, parse_request({"name": "ns.db", "qos": "dedicated_cores", "cpus": 4,
                                                    "numa_binding": True}))
    state = state.with_allocation(decision)
    report = build_nrt("node-a", topo, state, pools(topo, state), {"ns.db": 8 * GIB}, 3000, GIB, "Online",
                       ["uid-1"], now=1_800_000_000)
    zones = {z["name"]: {r["name"]: r for r in z["resources"]} for z in report["zones"]}
    bound = decision.mems[0]
    per_zone = len(topo.cpus_in_numa(bound))
    assert zones[f"node-{bound}"]["cpu"]["available"] == str(per_zone - 4)  # whole cpus: no "m"
    assert int(zones[f"node-{bound}"]["memory"]["available"]) == int(zones[f"node-{bound}"]["memory"]["capacity"]) \
        - 8 * GIB
    assert all(z["type"] == "Node" and z["costs"] for z in report["zones"])
    back = to_report(json.loads(json.dumps(report)))
    assert back.reclaimed_millicpu == 3000 and back.updated == 1_800_000_000 and back.state == "Online"
    assert back.zones[bound].millicpu == (per_zone - 4) * 1000
    assert back.attributes["tidal.io/pods"] == "uid-1"


def recorded(name):
    return json.loads((FIXTURES / name).read_text())


def node_report(name, zone_cpus, updated=None, pods=""):
    from cluster.placement.model import NodeReport, Zone
    import time

    return NodeReport(name, [Zone(c * 1000, 40 * GIB) for c in zone_cpus], reclaimed_millicpu=2000,
                      reclaimed_memory=GIB, updated=updated or time.time(), attributes={"tidal.io/pods": pods})


def test_extender_filter_on_a_recorded_scheduler_body():
    """The body kube-scheduler sent for a 12-cpu NUMA-bound pod (recorded from the e2e tier)."""
    args = recorded("filter-numa-bound.json")
    assert args["NodeNames"] == ["n-big", "n-small", "n-mid"]
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16]))
    cache.put(node_report("n-small", [2] * 8))
    cache.put(node_report("n-mid", [8] * 8))
    result = cache.filter(args["Pod"], args["NodeNames"])
    assert result["NodeNames"] == ["n-big"]
    assert set(result["FailedNodes"]) == {"n-small", "n-mid"}
    assert "no NUMA zone with 12 cpus" in result["FailedNodes"]["n-small"]


def test_extender_treats_missing_and_stale_reports_as_unknown():
    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16], updated=1.0))  # ancient
    result = cache.filter(args["Pod"], args["NodeNames"])
    assert result["NodeNames"] == []
    assert result["FailedNodes"]["n-big"].startswith("topology report older than")
    assert result["FailedNodes"]["n-small"] == "no topology report"
    ordinary = copy.deepcopy(args["Pod"])
    ordinary["metadata"]["annotations"] = {}
    ordinary["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "500m"}}
    ordinary.pop("status", None)
    assert cache.filter(ordinary, args["NodeNames"])["NodeNames"] == args["NodeNames"]  # others are not blocked


def test_extender_prioritize_packs_and_reserves_bound_pods_until_reported():
    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16]))
    cache.put(node_report("n-huge", [32, 32]))
    scores = {h["Host"]: h["Score"] for h in cache.prioritize(args["Pod"], ["n-big", "n-huge"])}
    assert 0 <= scores.get("n-huge", 0) < scores["n-big"] <= 10  # pack: the tighter node scores higher
    assert all(v > 0 for v in scores.values())  # a 0 is left out: to kube-scheduler it adds nothing
    bind = recorded("bind.json")
    spec = pod_spec(args["Pod"])
    cache.reserve(bind["Node"], spec, bind["PodUID"])
    cache.reserve(bind["Node"], spec, "second-pod")
    assert cache.filter(args["Pod"], ["n-big"])["NodeNames"] == []  # both zones reserved
    cache.put(node_report("n-big", [4, 16], pods=bind["PodUID"]))  # the node reports the first pod
    assert cache.filter(args["Pod"], ["n-big"])["NodeNames"] == []  # the second is still reserved
    cache.put(node_report("n-big", [4, 4], pods=f"{bind['PodUID']},second-pod"))
    assert cache.reserved["n-big"] == []


def test_a_binding_the_node_reported_before_it_was_reserved_is_not_counted_twice():
    """The node admits and reports a pod while its binding is still being answered: the reservation that
    follows must not take a second zone (the report has the pod; nothing would drop the reservation until
    the node's next changed report)."""
    args = recorded("filter-numa-bound.json")
    bind = recorded("bind.json")
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16]))
    cache.put(node_report("n-big", [4, 16], pods=bind["PodUID"]))  # reported first
    cache.reserve(bind["Node"], pod_spec(args["Pod"]), bind["PodUID"])
    assert cache.reserved.get("n-big", []) == []
    assert cache.filter(args["Pod"], ["n-big"])["NodeNames"] == ["n-big"]  # the other zone still fits one


def test_prioritize_json_says_what_prioritize_says():
    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    for i, cpus in enumerate(([16, 16], [32, 32], [8] * 8, [12, 4])):
        cache.put(node_report(f"n{i}", cpus))
    names = ["n0", "n1", "n2", "n3", "unknown"]
    fast = json.loads(cache.prioritize_json(args["Pod"], names))
    assert sorted(map(json.dumps, fast)) == sorted(map(json.dumps, cache.prioritize(args["Pod"], names)))
    odd = ["we\"ird", "n0"]  # not a DNS name: falls back to json.dumps, still valid JSON
    assert json.loads(cache.prioritize_json(args["Pod"], odd)) == cache.prioritize(args["Pod"], odd)
    assert {h["Host"] for h in cache.prioritize(args["Pod"], odd)} == {"n0"}


def test_moving_a_pod_to_other_cpus_keeps_containers_inside_the_pod_at_every_step(topo_dual_socket_ht, tmp_path, make_agent):
    from dataclasses import replace

    from agent.topology.parse import format_cpulist, parse_cpulist

    cgroups = RecordingCgroups()
    pod_path, container = "kubepods/pod0f1e-22", "kubepods/pod0f1e-22/abc"
    for path in ("kubepods", pod_path, container):
        cgroups.create(path)
    spec = pod(cpu="2")
    spec["status"] = {"qosClass": "Guaranteed", "containerStatuses": [{"containerID": "containerd://abc"}]}
    request = pod_request(spec)
    agent = pod_agent(topo_dual_socket_ht, make_agent, cgroups)
    agent.admit(request.document, source="kubernetes")
    agent.place(request.workload, KubeletLayout(cgroups).paths(spec, request))
    alloc = agent.state.get(request.workload)
    first = set(alloc.cpus)
    moved = replace(alloc, cpus=tuple(c for c in topo_dual_socket_ht.online_cpus() if c not in first)[:2])
    cgroups.ops.clear()
    with agent.lock:
        agent.owner.commit(agent.state.without(alloc.name).with_allocation(moved))
        agent.reconcile()
    cpus_writes = [(op[1], op[4]) for op in cgroups.ops if op[0] == "write" and op[3] == "cpuset.cpus"
                   and op[1].startswith("kubepods/")]
    assert cpus_writes[0] == (pod_path, format_cpulist(first | set(moved.cpus)))  # the pod widens first
    held = {pod_path: first, container: first}
    for path, text in cpus_writes:  # v1 nesting: at every step the container stays inside the pod
        held[path] = set(parse_cpulist(text))
        assert held[container] <= held[pod_path], cpus_writes
    assert held == {pod_path: set(moved.cpus), container: set(moved.cpus)}
    assert cpus_writes[-1] == (pod_path, format_cpulist(moved.cpus))  # and narrows last
    # the kubelet's values were saved before the first write: a revert puts them back
    assert (pod_path, "cpuset", "cpuset.cpus") in agent.enforcement.reconciler.originals


def test_filter_json_says_what_filter_says():
    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16]))
    cache.put(node_report("n-small", [2] * 8))
    cache.put(node_report("n-old", [16, 16], updated=1.0))
    names = ["n-big", "n-small", "n-old", "n-none"]
    assert json.loads(cache.filter_json(args["Pod"], names)) == cache.filter(args["Pod"], names)
    cache.put(node_report("n-big", [2, 2]))  # a new report: the cached fit must not be reused
    assert json.loads(cache.filter_json(args["Pod"], ["n-big"]))["NodeNames"] == []


def _go_body(pod, names):
    """An ExtenderArgs body as kube-scheduler's Go encoder writes it (no spaces)."""
    return json.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}, separators=(",", ":")).encode()


def test_read_args_recognises_a_list_it_has_seen_and_the_filter_answer_it_sent():
    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    for name, cpus in (("n-big", [16, 16]), ("n-small", [2] * 8), ("n-mid", [8] * 8)):
        cache.put(node_report(name, cpus))
    pod, first_names = cache.read_args(_go_body(args["Pod"], args["NodeNames"]))
    assert first_names == args["NodeNames"] and pod["Pod"] == args["Pod"]
    again, names = cache.read_args(_go_body(args["Pod"], args["NodeNames"]))
    assert names is first_names and again["Pod"] == args["Pod"]  # recognised: not decoded again
    answer = json.loads(cache.filter_json(args["Pod"], names))
    _, passed = cache.read_args(_go_body(args["Pod"], answer["NodeNames"]))
    assert passed == ["n-big"] and passed is cache._last_passed[1].names
    # a body whose pod carries the same list bytes somewhere else is decoded in full, not mistaken
    tricky = json.loads(json.dumps(args["Pod"]))
    tricky["metadata"]["NodeNames"] = args["NodeNames"]
    body = _go_body(tricky, ["n-mid"])
    decoded, names = cache.read_args(body)
    assert names == ["n-mid"] and decoded["Pod"]["metadata"]["NodeNames"] == args["NodeNames"]
    # the sentinel itself sent as NodeNames is not a list of names: decoded and refused
    import pytest

    with pytest.raises(ValueError):
        cache.read_args(b'{"Pod":{},"NodeNames":"\\u0000tidal-known-names"}')
    with pytest.raises(ValueError):
        cache.read_args(b'{"Pod":{},"NodeNames":[1,2]}')
    with pytest.raises(ValueError):
        cache.read_args(b'[1]')


def test_prepared_scores_are_served_only_while_nothing_has_moved():
    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16]))
    cache.put(node_report("n-huge", [32, 32]))
    names = ["n-big", "n-huge"]
    passed = json.loads(cache.filter_json(args["Pod"], names))["NodeNames"]
    cache.prepare_prioritize(args["Pod"])
    prepared = cache._prepared[4]
    assert cache.prioritize_json(args["Pod"], passed) is prepared  # served as prepared
    assert json.loads(prepared) == cache.prioritize(args["Pod"], passed)
    cache.put(node_report("n-huge", [12, 12]))  # now n-huge is the tighter fit
    fresh = json.loads(cache.prioritize_json(args["Pod"], passed))
    assert fresh == cache.prioritize(args["Pod"], passed) and fresh != json.loads(prepared)
    other = json.loads(json.dumps(args["Pod"]))
    other["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "2", "memory": "1Gi"},
                                                   "limits": {"cpu": "2", "memory": "1Gi"}}
    cache.filter_json(args["Pod"], names)
    cache.prepare_prioritize(args["Pod"])
    assert json.loads(cache.prioritize_json(other, passed)) == cache.prioritize(other, passed)  # its own scores
    assert cache._prepared[0] != pod_spec(other)


def test_fits_brought_up_to_date_row_by_row_equal_a_full_computation():
    """After bindings and new reports, a kept fit patched on the changed rows is what computing it
    over the whole cluster gives (and a filter answer reused only when no verdict changed)."""
    import random
    import time

    from cluster.placement.model import PodSpec

    rng = random.Random(7)
    cache = TopologyCache(stale_after=600)
    names = [f"n{i}" for i in range(60)]
    for name in names:
        cache.put(node_report(name, [rng.choice((4, 8, 16))] * rng.choice((1, 2, 4))))
    specs = [PodSpec("dedicated", 4000, GIB, numa_bound=True), PodSpec("shared", 1500, GIB),
             PodSpec("reclaimed", 500, GIB // 2)]
    pods = {"dedicated": recorded("filter-numa-bound.json")["Pod"]}
    for step in range(300):
        spec = rng.choice(specs)
        with cache.lock:
            cache._ensure_view()
            kept = cache._fit(spec)
            full, _ = cache.placer.node_fit(spec, now=time.time())
        assert kept.tolist() == full.tolist(), f"step {step}: {spec}"
        if rng.random() < 0.7:
            cache.reserve(rng.choice(names), spec, f"uid-{step}")
        else:
            cache.put(node_report(rng.choice(names), [rng.choice((2, 4, 8, 16))] * 2))
        answer = cache.filter(pods["dedicated"], names)
        cache.lock.acquire()
        try:
            cache._answers.clear()  # computed afresh for the comparison
        finally:
            cache.lock.release()
        assert cache.filter(pods["dedicated"], names) == answer


def test_extender_over_http_filter_then_prioritize_and_bad_bodies():
    """The served verbs on loopback: a filter, then prioritize with its answer (as the scheduler
    sends it back), then bodies that are not ExtenderArgs: one 400 each, and the server goes on."""
    import http.client

    from cluster.extender import serve

    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16]))
    cache.put(node_report("n-huge", [32, 32]))
    cache.put(node_report("n-small", [2] * 8))
    times = []
    server = serve(cache, 0, handler_times=times)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)

        def post(verb, body):
            conn.request("POST", f"/{verb}", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())

        names = ["n-big", "n-huge", "n-small", "n-none"]
        status, filtered = post("filter", _go_body(args["Pod"], names))
        assert status == 200 and filtered["NodeNames"] == ["n-big", "n-huge"]
        assert set(filtered["FailedNodes"]) == {"n-small", "n-none"}
        status, scores = post("prioritize", _go_body(args["Pod"], filtered["NodeNames"]))
        assert status == 200 and scores == cache.prioritize(args["Pod"], ["n-big", "n-huge"])
        for bad in (b"{not json", b'{"Pod":{},"NodeNames":"n-big"}', b'{"Pod":{},"NodeNames":[1]}', b"[]",
                    b'{"Pod":{},"Nodes":{"items":[{"name":"x"}]}}'):
            status, answer = post("filter", bad)
            assert status == 400 and answer["Error"].startswith("malformed request"), bad
        status, again = post("filter", _go_body(args["Pod"], names))
        assert status == 200 and again == filtered
        assert [path for path, _ in times][:2] == ["/filter", "/prioritize"] and len(times) == 8
    finally:
        server.shutdown()


def test_the_extender_answers_hostile_bodies_with_one_4xx_and_stays_up():
    """#17: a 300 MB body grew the process by 600 MB, deep nesting dropped the connection unanswered,
    a node name with a newline made the answer invalid JSON, other methods answered HTML."""
    import http.client
    import socket

    from cluster.extender import MAX_BODY, serve

    args = recorded("filter-numa-bound.json")
    cache = TopologyCache(stale_after=60)
    cache.put(node_report("n-big", [16, 16]))
    server = serve(cache, 0)
    port = server.server_address[1]
    try:
        def call(method, body=None, headers=None):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request(method, "/filter", body, {"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            data = response.read()
            conn.close()
            return response.status, json.loads(data)

        # a body over the limit is refused from its Content-Length, before it is read
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(f"POST /filter HTTP/1.1\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
            head = raw.recv(4096)
        assert head.startswith(b"HTTP/1.1 413 ")
        status, answer = call("POST", b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and "malformed request" in answer["Error"]
        odd = ["n-big", "evil\nname", 'q"uote']
        status, answer = call("POST", _go_body(args["Pod"], odd))  # valid JSON whatever the names
        assert status == 200 and answer["NodeNames"] == ["n-big"] and set(answer["FailedNodes"]) == set(odd[1:])
        for method in ("GET", "PUT", "DELETE"):
            status, answer = call(method)
            assert status == 405 and "not allowed" in answer["Error"]
        status, answer = call("POST", _go_body(args["Pod"], ["n-big"]))
        assert status == 200 and answer["NodeNames"] == ["n-big"]  # still serving
    finally:
        server.shutdown()


def test_the_pod_watch_and_the_report_loop_never_deadlock(topo_dual_socket_ht, tmp_path):
    """The watch admits pods while the report loop reads the agent's state, on two threads. They
    once took the node agent's lock and the agent's in opposite orders and froze each other (no
    error, no admission, no report): hammer both paths at once and require both to finish."""
    import threading

    from kubernetes import client

    from agent.daemon import Agent, AgentConfig
    from agent.k8s.node import KubeNodeAgent

    agent = Agent(AgentConfig(state_dir=str(tmp_path / "st"), cgroups_in_memory=True, reserved_cpus=()),
                  echo=lambda line: None, topology=topo_dual_socket_ht)
    agent.start()
    node = KubeNodeAgent(agent, FakeRest(), "n")  # neither path below calls it
    done = {"watch": 0, "report": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            doc = pod(f"p{done['watch']}", cpu="100m", memory="16Mi", limits=False, uid=f"u-{done['watch']}")
            node.on_pod(doc)
            node.on_pod(dict(doc, metadata=dict(doc["metadata"], deletionTimestamp="2026-01-01T00:00:00Z")))
            done["watch"] += 1

    def report():
        while not stop.is_set():
            node.nrt()
            done["report"] += 1

    threads = [threading.Thread(target=watch, daemon=True), threading.Thread(target=report, daemon=True)]
    for thread in threads:
        thread.start()
    stop.wait(3.0)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads), f"deadlocked after {done}"
    assert done["watch"] > 20 and done["report"] > 20, done
    assert not node.pods and not node.refused  # every pod admitted was released again


@pytest.mark.parametrize("which", ["official", "lean"])
def test_an_api_server_that_accepts_and_never_answers_is_an_error_not_a_hang(monkeypatch, which):
    """Every call carries a client-side timeout (``kube/timeouts.py``): without one a client waits forever
    on a connection that went quiet. The official client (the extender, the lending controller) passes
    ``_request_timeout``; the lean one (the node agent, the scheduler, the metrics server) has its
    connection's timeout (here 1 s instead of its 30, the time the test waits)."""
    import socket
    import threading

    from kubernetes import client

    from contracts.nrt import GROUP, PLURAL, VERSION
    from kube import timeouts
    from kube.crd import check_crd
    from kube.rest import Rest

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    port = server.getsockname()[1]
    config = client.Configuration(host=f"http://127.0.0.1:{port}")
    config.retries = False
    monkeypatch.setattr(timeouts, "CALL", (1.0, 1.0))
    outcome = {}
    if which == "official":
        def list_one():
            return client.CustomObjectsApi(client.ApiClient(config)).list_cluster_custom_object(
                GROUP, VERSION, PLURAL, limit=1, _request_timeout=timeouts.CALL)
    else:
        rest = Rest("127.0.0.1", port, None, {}, timeout=1.0)

        def list_one():
            return rest.json("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}?limit=1")

    def call():
        try:
            check_crd(list_one)
            outcome["result"] = "answered"
        except Exception as exc:  # noqa: BLE001 - what matters is that it returns
            outcome["result"] = str(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=15)
    server.close()
    assert not caller.is_alive(), "the call hung on a silent API server"
    assert "timed out" in outcome["result"].lower(), outcome
    assert timeouts.watch(30)[1] > 30  # a quiet but healthy watch outlives the server's own timeout


def test_the_pod_fingerprint_is_upstreams():
    """podfingerprint v0.2.2's own test data and vectors (tests/fixtures/podfingerprint)."""
    from contracts.nrt import pods_fingerprint

    pods = json.loads((FIXTURES.parent / "podfingerprint" / "pods.json").read_text())
    assert len(pods) == 259
    assert pods_fingerprint((p["namespace"], p["name"]) for p in pods) == "pfp0v001e477a4e3b2fc0ec6"
    five = [("ns1", "n1"), ("ns1", "n2"), ("ns2", "n1"), ("ns3", "n1"), ("ns3", "n2")]
    assert pods_fingerprint(five) == pods_fingerprint(reversed(five)) == "pfp0v001b92008c14168b3a6"
    assert pods_fingerprint([("ns1", "n1")]) != pods_fingerprint([("ns1n", "1")])  # not the concatenation


def test_the_report_states_the_policy_and_counts_pods_as_the_plugin_does(topo_dual_socket_ht):
    from contracts.nrt import counted_by_the_plugin, cpu_quantity, pods_fingerprint

    topo = topo_dual_socket_ht
    state = initial_state(topo, ())
    report = build_nrt("node-a", topo, state, pools(topo, state), {}, 0, 0, "Online", [], now=1_800_000_000,
                       counted_pods=[("default", "a"), ("kube-system", "b")], topology_policy="single-numa-node")
    attributes = {a["name"]: a["value"] for a in report["attributes"]}
    assert attributes["topologyManagerPolicy"] == "single-numa-node"
    assert attributes["topologyManagerScope"] == "pod"
    assert attributes["nodeTopologyPodsFingerprint"] == pods_fingerprint([("kube-system", "b"), ("default", "a")])
    assert attributes["nodeTopologyPodsFingerprintMethod"] == "all"
    assert cpu_quantity(14000) == "14" and cpu_quantity(13500) == "13500m" and cpu_quantity(0) == "0"
    bound = {"spec": {"nodeName": "n"}}
    assert not counted_by_the_plugin({**bound, "status": {"phase": "Pending"}})
    assert all(counted_by_the_plugin({**bound, "status": {"phase": p}}) for p in ("Running", "Succeeded", "Failed"))
    assert not counted_by_the_plugin({"spec": {}, "status": {"phase": "Running"}})


def test_single_numa_node_binds_every_dedicated_pod():
    from contracts.pods import pod_request

    def pod(annotations=None):
        return {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "annotations": annotations or {}},
                "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "4", "memory": "1Gi"},
                                                                   "limits": {"cpu": "4", "memory": "1Gi"}}}]}}

    assert "numa_binding" not in pod_request(pod()).document
    bound = pod_request(pod(), "single-numa-node")
    assert bound.document["numa_binding"] is True and bound.problem is None
    overruled = pod_request(pod({"tidal.io/numa-binding": "false"}), "single-numa-node")
    assert overruled.document["numa_binding"] is True and "single-numa-node" in overruled.problem
    assert "numa_binding" not in pod_request(pod(), "restricted").document
    from agent.qrm.model import Rejection
    from agent.topology.synthetic import Shape, build_topology

    topo = build_topology(Shape(sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=2))
    big = dict(bound.document, cpus=10)
    refused = allocate(topo, initial_state(topo, ()), parse_request(big, pod=True))  # 8 cpus per node: never on one
    assert isinstance(refused, Rejection) and "single-numa-node" in refused.reason
    spread = allocate(topo, initial_state(topo, ()), parse_request(dict(big, single_numa_node=False), pod=True))
    assert spread.mems == (0, 1)  # without the policy, the fewest whole nodes


@pytest.mark.parametrize("text, pod", [
    ("12:cpuset:/kubepods/burstable/pod1a2b/c0ffee\n0::/kubepods/burstable/pod1a2b/c0ffee\n",
     "/kubepods/burstable/pod1a2b/c0ffee"),
    ("0::/kubepods.slice/kubepods-pod1a2b.slice/cri-containerd-c0ffee.scope\n",
     "/kubepods.slice/kubepods-pod1a2b.slice/cri-containerd-c0ffee.scope"),
    ("3:cpuset:/tidal/system\n0::/system.slice/tidal.service\n", None),
], ids=["cgroupfs-v1", "systemd-v2", "systemd-unit"])
def test_the_agent_knows_when_it_runs_in_a_kubelet_pod(tmp_path, text, pod):
    from agent.daemon import kubelet_pod_of_self

    path = tmp_path / "cgroup"
    path.write_text(text)
    assert kubelet_pod_of_self(str(path)) == pod


def test_the_extender_bounds_what_a_body_costs_and_how_many_are_decoded_at_once(tmp_path):
    """#32: a 31 MiB body of small values took 657 MB (four at once peaked at 1.7 GB); whole Node objects
    were held whole. Now: values counted before decoding (over 1,000,000: 400), two decodes at once,
    Node objects cut to their names as they are decoded. Measured on the extender as its own process."""
    import http.client
    import socket
    import subprocess
    import sys
    import threading

    from cluster.extender import MAX_BODY, MAX_VALUES, TopologyCache

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "import time\nfrom cluster.extender import serve, TopologyCache\n"
                             f"serve(TopologyCache(), {port})\nprint('up', flush=True)\ntime.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        hostile = b'{"Pod":{},"X":[' + b",".join([b"[1]"] * ((MAX_BODY - 4096) // 4)) + b"]}"
        assert len(hostile) < MAX_BODY

        def post(body, answers):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/filter", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answers.append((response.status, json.loads(response.read())))
            conn.close()

        answers = []
        threads = [threading.Thread(target=post, args=(hostile, answers)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(status for status, _ in answers) == [400] * 4, answers
        assert all(f"at most {MAX_VALUES}" in answer["Error"] for _, answer in answers)
        with open(f"/proc/{proc.pid}/status") as handle:
            peak_kib = next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:"))
        assert peak_kib < 250 * 1024, peak_kib  # the four bodies themselves are 124 MiB; decoding added none
        # whole Node objects, as a scheduler without nodeCacheCapable sends them: their names come through
        nodes = [{"metadata": {"name": f"n{i}", "labels": {"a": "b"}},
                  "status": {"capacity": {"cpu": "8"}, "images": [{"names": ["x" * 100]}] * 20}} for i in range(500)]
        out = []
        post(json.dumps({"Pod": {"metadata": {"name": "p", "namespace": "d"}}, "Nodes": {"items": nodes}}).encode(),
             out)
        answered = set(out[0][1].get("NodeNames") or []) | set(out[0][1].get("FailedNodes") or {})
        assert out[0][0] == 200 and answered == {f"n{i}" for i in range(500)}, out
    finally:
        proc.kill()
        proc.wait()
    cache = TopologyCache()
    args, names = cache.read_args(json.dumps({"Pod": {"status": {"phase": "Pending"}, "metadata": {"name": "p"}},
                                              "Nodes": {"items": nodes[:3]}}).encode())
    assert names == ["n0", "n1", "n2"] and args["Pod"]["status"] == {"phase": "Pending"}  # a Pod is left whole


def test_the_extender_binds_only_for_a_client_certificate_off_loopback():
    import http.client

    from cluster.extender import serve

    bound = []
    server = serve(TopologyCache(), 0, binding=(lambda *a: bound.append(a), lambda ns, name: {}),
                   bind_needs_certificate=True)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        conn.request("POST", "/bind", json.dumps({"PodName": "p", "PodNamespace": "d", "PodUID": "u", "Node": "n"}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 403 and "client certificate" in json.loads(response.read())["Error"]
        assert bound == []
    finally:
        server.shutdown()


def test_a_kubelet_restarted_with_the_static_cpu_manager_is_a_conflict_in_status_and_metrics(topo_dual_socket_ht, tmp_path, make_agent):
    from agent.reporter.metrics import render

    agent = pod_agent(topo_dual_socket_ht, make_agent, RecordingCgroups())
    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    node = KubeNodeAgent(agent, _NoApi(), "n1", kubelet_root=str(kubelet))
    try:
        node.check_kubelet()  # no checkpoint yet: no conflict
        assert agent.status()["conflicts"] == {}
        assert 'tidal_conflict{kind="kubelet_cpu_manager"} 0.0' in render(agent).decode()
        (kubelet / "cpu_manager_state").write_text('{"policyName": "static", "defaultCpuSet": "0-7", "checksum": 1}')
        node.check_kubelet()
        assert "cpuManagerPolicy to none" in agent.status()["conflicts"]["kubelet_cpu_manager"]
        assert 'tidal_conflict{kind="kubelet_cpu_manager"} 1.0' in render(agent).decode()
        (kubelet / "cpu_manager_state").write_text('{"policyName": "none", "defaultCpuSet": "", "checksum": 1}')
        node.check_kubelet()
        assert agent.status()["conflicts"] == {}
    finally:
        agent.shutdown()


def test_the_node_agent_follows_its_watched_node_and_never_reads_it_each_period(topo_dual_socket_ht, make_agent):
    """The lending label and the state annotation from the Node as the watch brought it: a report period
    reads nothing (the agent that read its Node every second made every node of a cluster a read of etcd a
    second), and the annotation is written once for each state and version of the node, again when
    someone took it away."""
    from contracts.states import CURRENT_ANNOTATION, STATE_LABEL

    agent = pod_agent(topo_dual_socket_ht, make_agent, RecordingCgroups())
    rest = FakeRest()
    node = KubeNodeAgent(agent, rest, "n1", notice="0s")
    node.follow_node_label()  # nothing watched yet: nothing done, nothing read
    assert rest.calls == []

    def watched(version, labels=None, annotations=None):
        node._on_node({"metadata": {"name": "n1", "resourceVersion": str(version), "labels": labels or {},
                                    "annotations": annotations or {}}})

    watched(1)
    for _ in range(5):
        node.follow_node_label()
    assert rest.calls == [("PATCH", "/api/v1/nodes/n1", {"metadata": {"annotations": {CURRENT_ANNOTATION: "Online"}}},
                           "application/strategic-merge-patch+json")]  # once, though five periods passed
    watched(2, annotations={CURRENT_ANNOTATION: "Online"})  # the watch brings the node as patched
    node.follow_node_label()
    assert len(rest.calls) == 1
    watched(3, labels={STATE_LABEL: "Offline"}, annotations={CURRENT_ANNOTATION: "Online"})  # lent
    for _ in range(3):
        agent.tick()
        node.follow_node_label()
    assert agent.lending.current.state == "Offline"
    assert [c[2]["metadata"]["annotations"][CURRENT_ANNOTATION] for c in rest.calls[1:]] == ["Offline"]
    watched(4, labels={STATE_LABEL: "Offline"})  # someone took the annotation away: written again
    node.follow_node_label()
    assert [c[2]["metadata"]["annotations"][CURRENT_ANNOTATION] for c in rest.calls[1:]] == ["Offline", "Offline"]
    assert all(method == "PATCH" for method, *_ in rest.calls)  # never a GET of the node


def test_a_role_that_may_not_watch_nodes_reads_the_node_each_period_instead(topo_dual_socket_ht, make_agent):
    """An agent upgraded before its RBAC (its role without list/watch on nodes) still follows the lending
    label: the watch's 403 turns on a read of the Node every period, said once; a watch that lists again
    turns it off."""
    from contracts.states import STATE_LABEL
    from kube.rest import ApiError

    agent = pod_agent(topo_dual_socket_ht, make_agent, RecordingCgroups())
    lent = {"metadata": {"name": "n1", "resourceVersion": "7", "labels": {STATE_LABEL: "Offline"}}}
    rest = FakeRest({("GET", "/api/v1/nodes/n1"): lent})
    node = KubeNodeAgent(agent, rest, "n1", notice="0s")
    refused = ApiError(403, "GET", "/api/v1/nodes?fieldSelector=metadata.name%3Dn1", b"forbidden")
    node._node_watch_error(refused)
    node._node_watch_error(refused)
    assert node.node_watch_refused and node.api_errors == 2
    for _ in range(3):
        agent.tick()
        node.follow_node_label()
    assert agent.lending.current.state == "Offline"
    assert [c[:2] for c in rest.calls].count(("GET", "/api/v1/nodes/n1")) == 3  # one read a period

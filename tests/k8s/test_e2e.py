"""End to end against a real control plane: etcd, kube-apiserver and kube-scheduler built from source.

Three Node objects (no kubelet) on three hwloc machines, one Tidal agent per
node (kernel writes recorded), the extender wired into the real scheduler, the
lending controller. Selected with ``pytest -m k8s``; skipped with the reason
when ``make k8s-testbin`` has not built the binaries.
"""

import threading
import time
import uuid

import pytest

from tests.k8s.controlplane import ControlPlane, free_port, install_manifests, wait_for
from tests.k8s.controlplane import testbin as find_testbin

BIN = find_testbin()
pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
              pytest.mark.skipif(BIN is None, reason="no control plane binaries: run `make k8s-testbin` "
                                                     "(builds kube-apiserver, kube-scheduler and etcd from source)")]

NODES = {"n-small": "16amd64-8n2c", "n-big": "32intel64-2p8co2t+8ve", "n-mid": "64amd64-4s2n4ca2co"}
GIB = 1 << 30


def test_a_missing_crd_is_a_clear_error_at_start(plane, api, hwloc_topologies, tmp_path_factory):
    from agent.daemon import Agent, AgentConfig
    from agent.k8s.node import KubeError, KubeNodeAgent
    from cluster.extender import NrtWatcher, TopologyCache
    from kube.rest import Rest
    from cluster.placement.model import PlacementError

    agent = Agent(AgentConfig(state_dir=str(tmp_path_factory.mktemp("nocrd")), cgroups_in_memory=True,
                              reserved_cpus=()), echo=lambda line: None,
                  topology=hwloc_topologies["16amd64-8n2c"])
    agent.start()
    with pytest.raises(KubeError, match="NodeResourceTopology CRD .* is not installed: kubectl apply -f deploy/"):
        KubeNodeAgent(agent, Rest.from_config(api.configuration, "tidal-agent"), "n-small").check()
    with pytest.raises(PlacementError, match="CRD .* is not installed"):
        NrtWatcher(TopologyCache(), api, threading.Event()).check_crd()


@pytest.fixture(scope="module")
def cluster(plane, api, hwloc_topologies, tmp_path_factory):
    """CRD, nodes, one agent per node, the extender and the scheduler."""
    from kubernetes import client

    from agent.daemon import Agent, AgentConfig
    from agent.k8s.node import KubeNodeAgent
    from cluster.extender import NrtWatcher, TopologyCache, serve
    from kube.rest import Rest

    install_manifests(api, "rbac.yaml", "agent-daemonset.yaml", "extender.yaml")  # accepted by a real API server
    core = client.CoreV1Api(api)
    stop = threading.Event()
    agents, nodes = {}, {}
    for name, fixture in NODES.items():
        topo = hwloc_topologies[fixture]
        memory = sum(n.memory_bytes or 0 for n in topo.numa_nodes)
        cpus = len(topo.online_cpus())
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
        status = {"capacity": {"cpu": str(cpus), "memory": str(memory), "pods": "110"},
                  "allocatable": {"cpu": str(cpus), "memory": str(memory), "pods": "110"},
                  "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                  "message": "registered by the e2e test", "lastHeartbeatTime":
                                  time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]}
        core.patch_node_status(name, {"status": status})
        # In-process agents on hwloc machines (this host has 2 cpus), kernel writes recorded (no kubelet here).
        # Test-only settings, none of them about liveness: a 0.2 s period so the tier reacts in seconds;
        # resize off so the reclaimed figures do not follow this test host's own load; a full drift
        # check every pass. The shipped settings (every default) are run by test_agent_process.py, which
        # starts `tidal agent --kube-node` as the DaemonSet does and keeps its pods for 90 s.
        agent = Agent(AgentConfig(state_dir=str(tmp_path_factory.mktemp(name)), cgroups_in_memory=True,
                                  reserved_cpus=(), period=0.2, resize=False, guard_interval=0,
                                  drift_check_period=0), echo=lambda line: None, topology=topo)
        agent.start()

        def tick(agent=agent):
            while not stop.wait(0.2):
                agent.tick()

        threading.Thread(target=tick, daemon=True).start()
        node_agent = KubeNodeAgent(agent, Rest.from_config(api.configuration, "tidal-agent"), name, resync=5,
                                   report_period=0.3, notice="1s")
        node_agent.start()
        agents[name], nodes[name] = node_agent, topo
    cache = TopologyCache(stale_after=60)
    watcher = NrtWatcher(cache, api, stop)
    watcher.check_crd()
    watcher.start()
    port = free_port()
    import os

    # the shipped wiring: HTTPS with client certificates (deploy/extender.yaml, deploy/scheduler-config.yaml)
    from cluster.extender import tls_context

    certs = plane.extender_certs()
    server = serve(cache, port, api_client=api, record_dir=os.environ.get("TIDAL_EXTENDER_RECORD"),
                   tls=tls_context(certs["tls_crt"], certs["tls_key"], certs["ca_crt"]))
    wait_for(lambda: len(cache.reports) == 3, "three topology reports in the extender")
    plane.start_scheduler(f"https://127.0.0.1:{port}/", tls=certs)
    yield {"agents": agents, "cache": cache, "core": core, "api": api, "topologies": nodes, "port": port,
           "certs": certs}
    stop.set()
    server.shutdown()
    for node_agent in agents.values():
        node_agent.close()


def pod_alloc(agent, name, namespace="default"):
    """The agent's allocation for a pod (named pod/<uid>; its label is <namespace>/<name>), or None."""
    return next((a for a in agent.state.allocations if a.label == f"{namespace}/{name}"), None)


def make_pod(name, cpu, memory, annotations=None, limits=True, extra=None):
    from kubernetes import client

    resources = {"requests": {"cpu": cpu, "memory": memory, **(extra or {})}}
    if limits:
        resources["limits"] = {"cpu": cpu, "memory": memory, **(extra or {})}
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name, annotations=annotations or {}),
                        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="pause",
                                                                             resources=resources)]))


def bound(core, name, timeout=60):
    return wait_for(lambda: core.read_namespaced_pod(name, "default").spec.node_name, f"pod {name} to be bound",
                    timeout)


def nrt(api, node):
    from kubernetes import client

    return client.CustomObjectsApi(api).get_cluster_custom_object("topology.node.k8s.io", "v1alpha2",
                                                                  "noderesourcetopologies", node)


def zone_cpu(report, zone):
    from contracts.pods import quantity

    res = next(z for z in report["zones"] if z["name"] == zone)["resources"]
    return quantity(next(r for r in res if r["name"] == "cpu")["available"])


def test_numa_bound_pods_go_only_where_one_zone_holds_them(cluster):
    core, api = cluster["core"], cluster["api"]
    tag = uuid.uuid4().hex[:5]
    numa = {"tidal.io/numa-binding": "true"}
    names = [f"numa-{tag}-{i}" for i in range(3)]
    # 12 cpus fit n-small (16) and n-mid (64) by totals, but only n-big has NUMA zones of 16 cpus
    for name in names:
        core.create_namespaced_pod("default", make_pod(name, "12", "8Gi", numa))
        if name != names[-1]:
            assert bound(core, name) == "n-big"
            # wait until n-big's agent admitted it and reported (one pod per zone)
            wait_for(lambda n=name: pod_alloc(cluster["agents"]["n-big"].agent, n), f"{name} admitted")
    # the third fits nowhere: the scheduler leaves it pending with the extender's reason
    def unschedulable():
        pod = core.read_namespaced_pod(names[-1], "default")
        return pod.spec.node_name is None and any(c.type == "PodScheduled" and c.status == "False"
                                                  and "NUMA zone" in (c.message or "")
                                                  for c in pod.status.conditions or [])
    wait_for(unschedulable, "the third NUMA-bound pod to be unschedulable")
    agent = cluster["agents"]["n-big"].agent
    zones = {tuple(agent.topology.numa_of(c) for c in pod_alloc(agent, n).cpus) for n in names[:2]}
    assert {z[0] for z in zones} == {0, 1} and all(len(set(z)) == 1 for z in zones)  # one zone each
    # the report tracks the allocations: each zone has at most 4 of its 16 cpus left
    report = wait_for(lambda: (lambda r: r if zone_cpu(r, "node-0") <= 4 and zone_cpu(r, "node-1") <= 4 else None)(
        nrt(api, "n-big")), "n-big's report to show both zones taken")
    assert report["attributes"]
    for name in names:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_ordinary_pods_schedule_and_their_cgroups_are_written_in_the_kubelet_layout(cluster):
    core = cluster["core"]
    tag = uuid.uuid4().hex[:5]
    names = [f"web-{tag}-{i}" for i in range(3)]
    for name in names:
        core.create_namespaced_pod("default", make_pod(name, "500m", "256Mi", limits=False))
    for name in names:
        node = bound(core, name)
        node_agent = cluster["agents"][node]
        uid = core.read_namespaced_pod(name, "default").metadata.uid
        wait_for(lambda: pod_alloc(node_agent.agent, name), f"{name} admitted on {node}")
        path = f"kubepods/burstable/pod{uid}"
        node_agent.agent.driver.create(path)  # what the kubelet does when it starts the pod
        from agent.topology.parse import format_cpulist

        # written by the agent's Reconciler within a period; the shared pool moves as other pods come and go,
        # and the pod's cpuset follows it
        files = node_agent.agent.driver.files
        wait_for(lambda: files[path].get(("cpuset", "cpuset.cpus")) == format_cpulist(node_agent.agent.pools().shared),
                 f"{path} to hold the shared pool")
        assert pod_alloc(node_agent.agent, name).source == "kubernetes"
        assert not [p for p in node_agent.agent.driver.files if p.startswith("tidal/shared/pod")]  # not Tidal's tree
    for name in names:
        core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_reclaimed_capacity_is_published_on_nodes_and_schedules_reclaimed_pods(cluster):
    core = cluster["core"]
    for name in NODES:
        from contracts.pods import quantity

        wait_for(lambda n=name: quantity(core.read_node(n).status.allocatable.get("tidal.io/reclaimed-millicpu",
                                                                                  "0")) > 0,
                 f"{name} to publish its reclaimed cpu")
    # the agents' metrics say when their report was last known current (what TidalReportStale reads)
    import re
    import time

    from agent.reporter.metrics import render

    for name in NODES:
        text = render(cluster["agents"][name].agent).decode()
        at = float(re.search(r'^tidal_report_timestamp_seconds\{report="nrt"\} (\S+)$', text, re.M).group(1))
        assert time.time() - 30 < at <= time.time(), (name, at)
    name = f"batch-{uuid.uuid4().hex[:5]}"
    pod = make_pod(name, "100m", "64Mi", {"tidal.io/tier": "low"}, limits=False,
                   extra={"tidal.io/reclaimed-millicpu": "1000"})
    pod.spec.containers[0].resources.limits = {"tidal.io/reclaimed-millicpu": "1000"}
    core.create_namespaced_pod("default", pod)
    node = bound(core, name)
    alloc = wait_for(lambda: pod_alloc(cluster["agents"][node].agent, name), "the reclaimed pod admitted")
    assert alloc.qos.value == "reclaimed_cores" and alloc.millicpu == 1000
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_a_malformed_annotation_gets_an_event_and_the_default_treatment(cluster):
    core = cluster["core"]
    name = f"odd-{uuid.uuid4().hex[:5]}"
    core.create_namespaced_pod("default", make_pod(name, "250m", "64Mi", {"tidal.io/qos-level": "turbo"},
                                                   limits=False))
    node = bound(core, name)
    alloc = wait_for(lambda: pod_alloc(cluster["agents"][node].agent, name), "the odd pod admitted")
    assert alloc.qos.value == "shared_cores"
    events = wait_for(lambda: [e for e in core.list_namespaced_event("default").items
                               if e.involved_object.name == name and e.reason == "TidalBadAnnotation"], "the event")
    assert "unknown level 'turbo'" in events[0].message
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_nrt_objects_are_checked_against_the_crd(cluster):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as caught:
        client.CustomObjectsApi(cluster["api"]).create_cluster_custom_object(
            "topology.node.k8s.io", "v1alpha2", "noderesourcetopologies",
            {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
             "metadata": {"name": "bogus"}, "zones": [{"name": "node-0", "type": "Node",
                                                       "resources": [{"name": "cpu", "capacity": "lots"}]}]})
    assert caught.value.status == 422


def test_the_lending_controller_moves_a_node_offline_and_back_with_its_agent(cluster):
    from cluster.lending import LendingController

    core, api = cluster["core"], cluster["api"]
    said = []
    dry = LendingController(api, threshold=0.9, dry_run=True, echo=said.append).step()
    assert dry and dry[0].startswith("lend ") and said[0].startswith("dry run: lend")
    assert not any((n.metadata.labels or {}).get("tidal.io/node-state") for n in core.list_node().items)
    actions = LendingController(api, threshold=0.9, echo=lambda line: None).step()
    lent = actions[0].split()[1].rstrip(":")
    node_agent = cluster["agents"][lent]
    wait_for(lambda: core.read_node(lent).metadata.annotations.get("tidal.io/node-state-current") == "Offline",
             f"{lent}'s agent to report Offline", timeout=30)
    assert node_agent.agent.lending.current.state == "Offline"
    assert core.read_node(lent).spec.unschedulable
    assert wait_for(lambda: next(a["value"] for a in nrt(api, lent)["attributes"]
                                 if a["name"] == "tidal.io/node-state") == "Offline", "the report to say Offline")
    # an online window (here: the whole day) takes it back
    actions = LendingController(api, threshold=0.9, windows=["00:00-12:00", "12:00-00:00"],
                                echo=lambda line: None).step()
    assert actions[0].startswith(f"take back {lent}") and "online window" in actions[0]
    wait_for(lambda: core.read_node(lent).metadata.annotations.get("tidal.io/node-state-current") == "Online",
             f"{lent}'s agent to report Online again", timeout=30)
    assert not core.read_node(lent).spec.unschedulable


def test_agents_keep_enforcing_while_the_api_server_is_away_and_catch_up(cluster, plane):
    core = cluster["core"]
    before = {n: len(a.agent.state.allocations) for n, a in cluster["agents"].items()}
    plane.stop_apiserver()
    time.sleep(2)
    assert {n: len(a.agent.state.allocations) for n, a in cluster["agents"].items()} == before
    plane.start_apiserver()
    name = f"late-{uuid.uuid4().hex[:5]}"
    wait_for(lambda: core.create_namespaced_pod("default", make_pod(name, "250m", "64Mi", limits=False)),
             "the API server to take a pod again", timeout=60)
    node = bound(core, name, timeout=90)
    wait_for(lambda: pod_alloc(cluster["agents"][node].agent, name), "the agent to catch up", timeout=60)
    assert any(a.api_errors for a in cluster["agents"].values())
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_the_extender_answers_only_callers_with_a_client_certificate(cluster):
    """#17: /bind binds any pod with the extender's service account, so no certificate, no answer."""
    import json
    import ssl
    import urllib.request

    url = f"https://127.0.0.1:{cluster['port']}/filter"
    body = json.dumps({"Pod": {"metadata": {"name": "x"}}, "NodeNames": ["n-big"]}).encode()
    anonymous = ssl.create_default_context(cafile=cluster["certs"]["ca_crt"])
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        urllib.request.urlopen(urllib.request.Request(url, data=body), context=anonymous, timeout=10).read()
    scheduler = ssl.create_default_context(cafile=cluster["certs"]["ca_crt"])
    scheduler.load_cert_chain(cluster["certs"]["client_crt"], cluster["certs"]["client_key"])
    answer = json.loads(urllib.request.urlopen(urllib.request.Request(url, data=body), context=scheduler,
                                               timeout=10).read())
    assert "NodeNames" in answer

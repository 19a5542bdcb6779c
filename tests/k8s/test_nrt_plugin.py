"""Tidal's NodeResourceTopology reports read by the upstream scheduler plugin, not only by Tidal's extender.

A kube-scheduler built from sigs.k8s.io/scheduler-plugins with its NodeResourceTopologyMatch
plugin (``make nrt-scheduler``), configured from ``deploy/nrt-scheduler-config.yaml``, and three
kubelet-less nodes on hwloc machines, one ``tidal agent --kube-node`` process each, started with
the DaemonSet's own command line plus ``--topology-policy single-numa-node``:

* ``n-small``: 8 NUMA nodes of 2 cpus; ``n-big``: 2 of 16; ``n-mid``: 8 of 8.

Guaranteed 12-cpu pods fit a single zone only on ``n-big``: two go there (one per zone), the
third stays Pending with the plugin's reason; once one is deleted and the node's next report
shows its zone free, the third is placed there. A 1-cpu pod fits everywhere and is scheduled.
Run four ways: the overreserve cache (which trusts a report only when its pod fingerprint is
the one the plugin computes itself) and passthrough; the plugin as the cluster's scheduler
(``default-scheduler``) and as a second scheduler that pods name.

No kubelet runs here: the test does the kubelet's one visible part, setting a bound pod's phase
to Running (the plugin counts only non-Pending pods in its fingerprint).
"""

from __future__ import annotations

import os
import re
import time
import uuid

import pytest
import yaml

from tests.k8s.controlplane import _tail, _wait, free_port, wait_for
from tests.k8s.controlplane import testbin as find_testbin
from tests.k8s.test_agent_process import AgentProcess, daemonset_command, register_node

PLUGINS_VERSION = os.environ.get("PLUGINS_VERSION", "0.34.7")
K8S_VERSION = os.environ.get("K8S_VERSION", "1.34.4")
NRT_SCHEDULER = os.path.join(
    os.environ.get("TIDAL_NRT_SCHEDULER") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tidal", "nrt-scheduler",
        f"v{PLUGINS_VERSION}-k{K8S_VERSION}"), "nrt-scheduler")

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
              pytest.mark.skipif(find_testbin() is None or not os.access(NRT_SCHEDULER, os.X_OK),
                                 reason="no control plane or plugin scheduler: run `make k8s-testbin nrt-scheduler`")]

NODES = {"n-small": "16amd64-8n2c", "n-big": "32intel64-2p8co2t+8ve", "n-mid": "64amd64-4s2n4ca2co"}


@pytest.fixture(scope="module")
def nodes(plane, api, hwloc_trees, hwloc_topologies, tmp_path_factory):
    """The CRD, three nodes and their agents (processes, as the DaemonSet runs them)."""
    from kubernetes import client, utils

    with open("deploy/crd-noderesourcetopology.yaml") as handle:
        utils.create_from_dict(api, yaml.safe_load(handle))
    core = client.CoreV1Api(api)
    workdir = tmp_path_factory.mktemp("nrt-plugin")
    agents = {}
    try:
        for name, fixture in NODES.items():
            register_node(core, name, hwloc_topologies[fixture])
            core.patch_node_status(name, {"status": {"conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "registered by the test",
                "lastHeartbeatTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]}})
            argv = daemonset_command(name, str(workdir / f"{name}-state"), str(workdir / f"{name}.sock"))
            # --root/--cgroups-in-memory: the node is an hwloc snapshot and no kubelet makes its pods' cgroups
            extra = ["--kubeconfig", plane.kubeconfig(), "--root", hwloc_trees[fixture], "--cgroups-in-memory",
                     "--topology-policy", "single-numa-node"]
            agents[name] = AgentProcess(name, argv + extra, str(workdir))
        for name in NODES:
            wait_for(lambda name=name: report(api, name), f"{name}'s first report", timeout=90)
        yield {"core": core, "api": api, "agents": agents}
    finally:
        for agent in agents.values():
            agent.stop()


def report(api, node):
    from kubernetes import client

    return client.CustomObjectsApi(api).get_cluster_custom_object("topology.node.k8s.io", "v1alpha2",
                                                                  "noderesourcetopologies", node)


def start_scheduler(plane, profile_name: str, resync_seconds: int):
    """The plugin's scheduler from the shipped configuration; only the profile's name, the cache
    mode and this test's kubeconfig differ (and leader election: one scheduler per run here)."""
    with open("deploy/nrt-scheduler-config.yaml") as handle:
        doc = yaml.safe_load(handle)
    doc["clientConnection"]["kubeconfig"] = plane.kubeconfig()
    doc["leaderElection"]["leaderElect"] = False
    (profile,) = doc["profiles"]
    profile["schedulerName"] = profile_name
    args = profile["pluginConfig"][0]["args"]
    assert args["cacheResyncPeriodSeconds"] > 0  # shipped: overreserve
    args["cacheResyncPeriodSeconds"] = resync_seconds
    tag = f"{profile_name}-{resync_seconds}"
    path = os.path.join(plane.dir, f"nrt-scheduler-{tag}.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(doc, handle)
    log = os.path.join(plane.dir, f"nrt-scheduler-{tag}.log")
    proc = plane._spawn(f"nrt-scheduler-{tag}", [NRT_SCHEDULER, f"--config={path}", f"--secure-port={free_port()}",
                                                   "--bind-address=127.0.0.1", "--v=4"])
    _wait(lambda: "Starting Kubernetes Scheduler" in _tail(log, 400), "the plugin's scheduler", timeout=90,
          proc=proc, log=log)
    return proc, log


FINGERPRINT_CHECK = re.compile(r'"podset fingerprint check".* node="([^"]+)" expected="([^"]*)" computed="([^"]*)"')


def fingerprints_settled(text: str):
    """The nodes whose last fingerprint check in the plugin's log matched, when every checked node's
    did (None while one still differs)."""
    last = {}
    for node, expected, computed in FINGERPRINT_CHECK.findall(text):
        last[node] = expected == computed
    return sorted(last) if last and all(last.values()) else None


def guaranteed(name, cpus, scheduler):
    from kubernetes import client

    amounts = {"cpu": str(cpus), "memory": "2Gi"}
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name),
                        spec=client.V1PodSpec(scheduler_name=scheduler, containers=[client.V1Container(
                            name="c", image="pause", resources={"requests": amounts, "limits": amounts})]))


def run_pod(core, name):
    """The kubelet's part: the bound pod runs."""
    core.patch_namespaced_pod_status(name, "default", {"status": {"phase": "Running"}})


def placed(core, name, timeout=60):
    return wait_for(lambda: core.read_namespaced_pod(name, "default").spec.node_name, f"{name} to be bound", timeout)


def zone_of(agents, node, pod):
    workload = agents[node].workloads().get(f"default/{pod}")
    if workload is None:
        return None
    from agent.topology.parse import parse_cpulist

    return set(parse_cpulist(workload["mems"]))


@pytest.mark.parametrize("profile", ["default-scheduler", "topology-aware-scheduler"], ids=["primary", "second"])
@pytest.mark.parametrize("resync", [5, 0], ids=["overreserve", "passthrough"])
def test_the_upstream_plugin_places_by_tidals_zones(plane, nodes, profile, resync):
    core, api, agents = nodes["core"], nodes["api"], nodes["agents"]
    attributes = {a["name"]: a["value"] for a in report(api, "n-big")["attributes"]}
    assert attributes["topologyManagerPolicy"] == "single-numa-node"
    assert attributes["nodeTopologyPodsFingerprint"].startswith("pfp0v001")
    proc, log = start_scheduler(plane, profile, resync)
    tag = uuid.uuid4().hex[:5]
    names = [f"big-{tag}-{i}" for i in range(3)]
    small = f"small-{tag}"
    try:
        for name in names[:2]:
            core.create_namespaced_pod("default", guaranteed(name, 12, profile))
            assert placed(core, name) == "n-big"  # the only node with a 16-cpu zone
            run_pod(core, name)
            wait_for(lambda name=name: zone_of(agents, "n-big", name), f"{name} admitted by n-big's agent")
        zones = [zone_of(agents, "n-big", n) for n in names[:2]]
        assert sorted(map(sorted, zones)) == [[0], [1]]  # one zone each
        core.create_namespaced_pod("default", guaranteed(names[2], 12, profile))

        def unschedulable():
            pod = core.read_namespaced_pod(names[2], "default")
            return pod.spec.node_name is None and next(
                (c.message for c in pod.status.conditions or [] if c.type == "PodScheduled" and c.status == "False"
                 and "cannot align" in (c.message or "")), None)

        message = wait_for(unschedulable, "the third 12-cpu pod to be unschedulable with the plugin's reason")
        assert "3 node(s)" in message or "n-big" not in message, message
        core.create_namespaced_pod("default", guaranteed(small, 1, profile))
        assert placed(core, small) in NODES  # fits everywhere
        run_pod(core, small)

        # a zone is freed: the next report says so, and the plugin places the third pod there
        freed = zone_of(agents, "n-big", names[0])
        core.delete_namespaced_pod(names[0], "default", grace_period_seconds=0)
        assert placed(core, names[2], timeout=90) == "n-big"
        run_pod(core, names[2])
        assert wait_for(lambda: zone_of(agents, "n-big", names[2]), "the third pod admitted") == freed
        assert proc.poll() is None, _tail(log)
        if resync:
            # the overreserve cache took Tidal's reports: their fingerprint matched the plugin's own.
            # A report may lag a pod's change by a moment (the plugin's informer saw the pod run before
            # the agent's next report): the plugin then keeps the node dirty and checks it again at its
            # next resync. What must hold is that every node's checks end in a match.
            assert "overriding cached info" in open(log).read(), _tail(log, 60)
            wait_for(lambda: fingerprints_settled(open(log).read()),
                     "every node's last fingerprint check to match", timeout=4 * resync + 30)
    finally:
        for name in [*names, small]:
            try:
                core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for name in [*names, small]:
            wait_for(lambda name=name: all(f"default/{name}" not in a.workloads() for a in agents.values()),
                     f"{name} released")
        plane.procs.pop(next(k for k, p in plane.procs.items() if p is proc))
        proc.terminate()
        proc.wait(timeout=20)

"""The cluster-wide policy (TidalPolicy) on a real API server, followed by the agent as the DaemonSet
runs it (its command line from deploy/agent-daemonset.yaml, real cgroups on this host: root only).

* The API server enforces the CRD's schema: a threshold out of range, a notice that is no duration,
  are refused with the field's path.
* A policy that selects the node reaches the running agent within one period (1 s) and shows in
  `tidal status`, the settings it sets take effect in the loops, a setting the node was given by a
  flag is kept, the NRT report names the policy; a policy of higher priority wins; an edit (a new
  generation) is applied; deleting it, then relabelling the node, brings the node back to its own
  settings. The agent process is the same one throughout: no restart.

Arguments beyond the manifest's are those of tests/k8s/test_agent_process.py (temporary state and
socket, a kubeconfig, a unique cgroup base), and ``--cpu-pressure-threshold 30``: the node's own
setting, which the policy must not override.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from tests.conftest import is_root
from tests.k8s.controlplane import install_manifests, wait_for
from tests.k8s.test_agent_process import AgentProcess, _remove_test_tree, daemonset_command, register_node

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

GROUP, VERSION, PLURAL = "tidal.io", "v1alpha1", "tidalpolicies"


@pytest.fixture(scope="module")
def crds(plane, api):
    install_manifests(api)  # the CRDs as deploy/ ships them


def policy(name, agent, selector=None, priority=0):
    spec = {"agent": agent, "priority": priority}
    if selector is not None:
        spec["nodeSelector"] = selector
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TidalPolicy", "metadata": {"name": name}, "spec": spec}


def test_the_api_server_refuses_a_bad_policy_with_the_fields_path(plane, api, crds):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    custom = client.CustomObjectsApi(api)
    for agent, path in (({"memoryPressureThreshold": 150}, "spec.agent.memoryPressureThreshold"),
                        ({"lendingNotice": "soon"}, "spec.agent.lendingNotice"),
                        ({"memoryEvictBelow": "lots"}, "spec.agent.memoryEvictBelow")):
        with pytest.raises(ApiException) as refused:
            custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, policy(f"bad-{uuid.uuid4().hex[:5]}", agent))
        assert refused.value.status == 422 and path in refused.value.body, refused.value.body
    # a field the schema does not have is refused too, where the client asks for strict validation (kubectl's
    # default): a typo never silently does nothing
    with pytest.raises(ApiException) as refused:
        custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, policy("typo", {"memoryPresureThreshold": 30}),
                                            field_validation="Strict")
    assert refused.value.status == 400 and "memoryPresureThreshold" in refused.value.body  # strict decoding


def test_a_policy_reaches_the_running_agent_within_one_period_without_a_restart(plane, api, crds, tmp_path):
    if not is_root():
        pytest.skip("the host node's agent writes real cgroups: run as root (the k8s tier in CI is)")
    from kubernetes import client

    from agent.client import AgentClient
    from agent.topology import HostFS, discover

    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    tag = uuid.uuid4().hex[:6]
    node, base = f"policy-host-{tag}", f"tidal-test-{tag}"
    register_node(core, node, discover(HostFS("/")))
    core.patch_node(node, {"metadata": {"labels": {"tidal.io/pool": "batch"}}})
    argv = daemonset_command(node, str(tmp_path / "state"), str(tmp_path / "a.sock"))
    agent = AgentProcess("host", argv + ["--kubeconfig", plane.kubeconfig(), "--cgroup-base", base,
                                         "--cpu-pressure-threshold", "30"], str(tmp_path))
    try:
        ask = AgentClient(agent.socket, timeout=10)
        wait_for(lambda: agent.workloads() is not None, "the agent to serve", timeout=60)
        pid = agent.proc.pid
        status = ask.request("GET", "/v1/status")
        assert status["policy"] is None
        assert status["settings"]["memory-pressure-threshold"] == {"value": 20.0, "source": "default"}
        assert status["settings"]["cpu-pressure-threshold"] == {"value": 30.0, "source": "local"}

        def follows(name, generation, timeout=10.0):
            """Seconds from now until the agent says it follows ``name`` at ``generation`` (None: its own)."""
            start = time.monotonic()
            want = None if name is None else (name, generation)
            while time.monotonic() - start < timeout:
                now = ask.request("GET", "/v1/status")["policy"]
                if (None if now is None else (now["name"], now["generation"])) == want:
                    return time.monotonic() - start
                time.sleep(0.02)
            pytest.fail(f"the agent did not follow {want} within {timeout}s:\n{agent.log()}")

        # a policy for the batch pool: within one period of its creation
        created = time.monotonic()
        custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, policy(
            f"batch-{tag}", {"memoryPressureThreshold": 35, "cpuPressureThreshold": 5, "evictionGrace": 30,
                             "reclaimBuffer": 0.4}, {"matchLabels": {"tidal.io/pool": "batch"}}))
        follows(f"batch-{tag}", 1)
        latency = time.monotonic() - created  # from the create call's start
        print(f"policy created -> applied and shown in status: {latency * 1000:.0f} ms")
        assert latency < 1.0, f"{latency:.2f}s: more than one period"
        status = ask.request("GET", "/v1/status")
        assert status["policy"]["applied"] == ["eviction-grace", "memory-pressure-threshold", "reclaim-buffer"]
        assert status["policy"]["kept_local"] == ["cpu-pressure-threshold"]
        assert status["settings"]["memory-pressure-threshold"] == {"value": 35.0, "source": "policy"}
        assert status["memory"]["pressure_threshold_percent"] == 35.0  # in the loop itself
        assert status["cpu_pressure"]["threshold_percent"] == 30.0  # the node's own flag kept
        # what an operator runs
        shown = json.loads(subprocess.run([sys.executable, "-m", "agent.cli", "status", "--socket", agent.socket,
                                           "--json"], capture_output=True, text=True, check=True, timeout=60).stdout)
        assert shown["policy"]["name"] == f"batch-{tag}" and shown["policy"]["generation"] == 1
        text = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--socket", agent.socket],
                              capture_output=True, text=True, check=True, timeout=60).stdout
        assert f"cluster policy: batch-{tag} (generation 1)" in text, text
        nrt = lambda: {a["name"]: a["value"] for a in custom.get_cluster_custom_object(  # noqa: E731
            "topology.node.k8s.io", "v1alpha2", "noderesourcetopologies", node).get("attributes", [])}
        wait_for(lambda: nrt().get("tidal.io/cluster-policy") == f"batch-{tag}/1", "the report to name the policy")

        # one of higher priority for every node wins; its edit (generation 2) is applied
        custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, policy(
            f"all-{tag}", {"memoryPressureThreshold": 50}, priority=10))
        follows(f"all-{tag}", 1)
        custom.patch_cluster_custom_object(GROUP, VERSION, PLURAL, f"all-{tag}",
                                           {"spec": {"agent": {"memoryPressureThreshold": 60}}})
        follows(f"all-{tag}", 2)
        status = ask.request("GET", "/v1/status")
        assert status["memory"]["pressure_threshold_percent"] == 60.0
        assert status["settings"]["eviction-grace"] == {"value": 10.0, "source": "default"}  # not merged

        # gone: back to the batch pool's; the node leaves the pool: back to its own, within a report period
        custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, f"all-{tag}")
        follows(f"batch-{tag}", 1)
        relabelled = time.monotonic()
        core.patch_node(node, {"metadata": {"labels": {"tidal.io/pool": None}}})
        follows(None, None)
        print(f"node relabelled -> its own settings: {(time.monotonic() - relabelled) * 1000:.0f} ms")
        status = ask.request("GET", "/v1/status")
        assert status["settings"]["memory-pressure-threshold"] == {"value": 20.0, "source": "default"}
        assert status["memory"]["pressure_threshold_percent"] == 20.0
        assert agent.proc.poll() is None and agent.proc.pid == pid  # the same process throughout
        custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, f"batch-{tag}")
    finally:
        code = agent.stop()
        left = _remove_test_tree(base)
    assert code == 0, agent.log()
    assert not left, f"cgroups the test made could not be removed: {left}"

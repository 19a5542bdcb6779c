"""The agent's authority on a real API server: RBAC as deploy/rbac.yaml ships it, narrowed to its own node.

A pod of the DaemonSet gets a service-account token bound to it; the API server puts the pod's node
into the token's user info. With exactly such a token (made with ``kubectl create token
--bound-object-kind Pod``, as the kubelet asks for one), ``kubectl`` shows what the agent may do:
``auth can-i`` for what RBAC bounds, and server-side dry runs for what the ValidatingAdmissionPolicy
bounds (its own Node, NodeResourceTopology and NodeUsage only). Nothing here is changed: every write is a dry run.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.k8s.controlplane import install_manifests, wait_for

pytestmark = pytest.mark.k8s


@pytest.fixture(scope="module")
def agent_token(plane, api):
    from kubernetes import client

    install_manifests(api, "rbac.yaml")
    core = client.CoreV1Api(api)
    for name in ("n-own", "n-other"):
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
        client.CustomObjectsApi(api).create_cluster_custom_object(
            "topology.node.k8s.io", "v1alpha2", "noderesourcetopologies",
            {"apiVersion": "topology.node.k8s.io/v1alpha2", "kind": "NodeResourceTopology",
             "metadata": {"name": name}, "topologyPolicies": ["None"], "zones": []})
        client.CustomObjectsApi(api).create_cluster_custom_object("tidal.io", "v1alpha1", "nodeusages", {
            "apiVersion": "tidal.io/v1alpha1", "kind": "NodeUsage", "metadata": {"name": name},
            "usage": {"timestamp": "2026-11-29T12:00:00.000000Z", "windowSeconds": 15, "pods": []}})
    # the DaemonSet's pod on n-own (no kubelet here: bound by nodeName, which is what the token records)
    core.create_namespaced_pod("tidal-system", client.V1Pod(
        metadata=client.V1ObjectMeta(name="tidal-agent-own"),
        spec=client.V1PodSpec(node_name="n-own", service_account_name="tidal-agent", automount_service_account_token=False,
                              containers=[client.V1Container(name="agent", image="tidal:0.1.0")])))
    done = kubectl(plane, None, "create", "token", "tidal-agent", "-n", "tidal-system", "--bound-object-kind", "Pod",
                   "--bound-object-name", "tidal-agent-own")
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    # the policy binding takes effect within a few seconds of its creation
    wait_for(lambda: "own node" in kubectl(plane, token, "annotate", "node", "n-other", "x=y", "--dry-run=server").stderr,
             "the ValidatingAdmissionPolicy to be in force", timeout=60)
    return token


def kubectl(plane, token, *args) -> subprocess.CompletedProcess:
    argv = [f"{plane.bin}/kubectl", f"--kubeconfig={plane.kubeconfig()}"]
    if token is not None:  # as the agent: its token, no admin credentials
        argv += [f"--token={token}"]  # replaces the kubeconfig's admin token
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=60)


def can_i(plane, token, *args) -> str:
    return kubectl(plane, token, "auth", "can-i", *args).stdout.strip()


def test_the_token_of_a_daemonset_pod_names_its_node(plane, agent_token):
    who = json.loads(kubectl(plane, agent_token, "auth", "whoami", "-o", "json").stdout)
    info = who["status"]["userInfo"]
    assert info["username"] == "system:serviceaccount:tidal-system:tidal-agent"
    assert info["extra"]["authentication.kubernetes.io/node-name"] == ["n-own"]


@pytest.mark.parametrize("verb, resource, want", [
    ("get", "nodes/n-own", "yes"), ("patch", "nodes/n-own", "yes"), ("list", "pods", "yes"),
    # its Node watched (a field selector on its name; RBAC cannot bound a watch to the token's node)
    ("watch", "nodes", "yes"), ("list", "nodes", "yes"),
    ("delete", "nodes/n-other", "no"), ("create", "pods", "no"), ("get", "secrets", "no"),
    ("create", "pods/eviction", "no"), ("create", "pods/binding", "no"), ("delete", "noderesourcetopologies", "no"),
    # the cluster policies: read (watched), never written by an agent
    ("watch", "tidalpolicies.tidal.io", "yes"), ("list", "tidalpolicies.tidal.io", "yes"),
    ("patch", "tidalpolicies.tidal.io", "no"), ("create", "tidalpolicies.tidal.io", "no"),
    # its pods' use: written (its own node's, below), never listed nor deleted
    ("patch", "nodeusages.tidal.io", "yes"), ("list", "nodeusages.tidal.io", "no"),
    ("delete", "nodeusages.tidal.io", "no"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_rbac_bounds_what_the_agent_may_do_at_all(plane, agent_token, verb, resource, want):
    assert can_i(plane, agent_token, verb, resource) == want


@pytest.mark.parametrize("args", [
    ("annotate", "node", "{node}", "tidal.io/node-state-current=Offline"),
    ("label", "node", "{node}", "probe=1"),
    ("patch", "noderesourcetopologies.topology.node.k8s.io", "{node}", "--type=merge", "-p",
     '{"attributes": [{"name": "tidal.io/probe", "value": "1"}]}'),
    ("patch", "nodeusages.tidal.io", "{node}", "--type=merge", "-p", '{"usage": {"windowSeconds": 5}}'),
], ids=["node-annotation", "node-label", "nrt", "nodeusage"])
def test_the_agent_changes_its_own_node_and_no_other(plane, agent_token, args):
    own = kubectl(plane, agent_token, *[a.replace("{node}", "n-own") for a in args], "--dry-run=server")
    assert own.returncode == 0, own.stderr
    other = kubectl(plane, agent_token, *[a.replace("{node}", "n-other") for a in args], "--dry-run=server")
    assert other.returncode != 0
    assert "tidal-agent may change only its own node (n-own), not n-other" in other.stderr, other.stderr
    # RBAC alone would have let it: can-i says yes for the other node's object
    resource = "nodes" if args[1] == "node" else args[1]
    assert can_i(plane, agent_token, "patch", f"{resource}/n-other") == "yes"


def test_a_token_bound_to_no_node_changes_no_node(plane, api, agent_token):
    done = kubectl(plane, None, "create", "token", "tidal-agent", "-n", "tidal-system")
    assert done.returncode == 0, done.stderr
    loose = done.stdout.strip()
    time.sleep(0.1)
    refused = kubectl(plane, loose, "annotate", "node", "n-own", "probe=1", "--dry-run=server")
    assert refused.returncode != 0 and "its token names no node" in refused.stderr, refused.stderr

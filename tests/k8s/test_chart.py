"""The chart on a real API server, as a user installs it: `helm install` creates every object (the CRDs
first), a server-side dry run of `helm template` is accepted, `helm upgrade` with a new agent setting
rewrites the agent's config file and rolls the DaemonSet (its pod template changes), `helm uninstall`
removes what it made. No kubelet runs here: the node tier installs the chart on a real node."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.k8s.controlplane import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

ROOT = Path(__file__).resolve().parents[2]
CHART = str(ROOT / "deploy" / "helm" / "tidal")


@pytest.fixture(scope="module")
def helm(plane):
    done = subprocess.run(["sh", str(ROOT / "scripts" / "helm.sh")], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr
    binary = done.stdout.strip()

    def run(*args, check=True):
        out = subprocess.run([binary, "--kubeconfig", plane.kubeconfig(), *args], capture_output=True, text=True,
                             timeout=300)
        if check:
            assert out.returncode == 0, out.stdout + out.stderr
        return out
    return run


def test_helm_installs_upgrades_and_uninstalls_tidal(plane, api, helm, tmp_path):
    from kubernetes import client

    apps, core, ext = client.AppsV1Api(api), client.CoreV1Api(api), client.ApiextensionsV1Api(api)
    namespace = f"tidal-{uuid.uuid4().hex[:5]}"
    helm("install", "tidal", CHART, "--namespace", namespace, "--create-namespace",
         "--set-string", "agent.config.reserved-cpus=0")
    for crd in ("noderesourcetopologies.topology.node.k8s.io", "tidalpolicies.tidal.io"):
        wait_for(lambda c=crd: ext.read_custom_resource_definition(c), f"{crd} installed")
    daemonset = apps.read_namespaced_daemon_set("tidal-agent", namespace)
    assert daemonset.spec.template.spec.containers[0].command[:4] == ["tidal", "agent", "--config",
                                                                        "/etc/tidal/agent.yaml"]
    config = yaml.safe_load(core.read_namespaced_config_map("tidal-agent-config", namespace).data["agent.yaml"])
    assert config["reserved-cpus"] == "0"
    deployment = apps.read_namespaced_deployment("tidal-extender", namespace)
    assert [c.name for c in deployment.spec.template.spec.containers] == ["extender", "lending"]
    assert core.read_namespaced_service("tidal-extender", namespace).spec.ports[0].port == 8890
    # the scheduler side: its Deployment (two replicas, one leading), its own service account (tests/k8s/
    # test_scheduler_tier.py runs it with that account's RBAC on KWOK nodes)
    scheduler = apps.read_namespaced_deployment("tidal-scheduler", namespace)
    assert scheduler.spec.replicas == 2
    assert scheduler.spec.template.spec.service_account_name == "tidal-scheduler"
    assert scheduler.spec.template.spec.containers[0].command[:3] == ["tidal", "cluster", "scheduler"]
    assert core.read_namespaced_service_account("tidal-scheduler", namespace)
    before = daemonset.spec.template.metadata.annotations["checksum/config"]
    # and what `helm template` renders (the plain manifests' way), the API server accepts whole: a server-side
    # dry run of every object, its namespace and the CRDs now there
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(helm("template", "tidal", CHART, "--namespace", namespace, "--include-crds",
                             "--set", "namespace.create=true", "--set", "monitoring.dashboard.enabled=true").stdout)
    done = subprocess.run([f"{plane.bin}/kubectl", f"--kubeconfig={plane.kubeconfig()}", "apply", "--dry-run=server",
                           "--server-side", "--force-conflicts", "-f", str(rendered)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "daemonset.apps/tidal-agent serverside-applied (server dry run)" in done.stdout, done.stdout
    assert "validatingadmissionpolicy.admissionregistration.k8s.io/tidal-agent-own-node" in done.stdout

    # a new setting: the file changes and the agents roll over to read it
    helm("upgrade", "tidal", CHART, "--namespace", namespace, "--reuse-values",
         "--set", "agent.config.memory-pressure-threshold=30")
    config = yaml.safe_load(core.read_namespaced_config_map("tidal-agent-config", namespace).data["agent.yaml"])
    assert config == {**config, "reserved-cpus": "0", "memory-pressure-threshold": 30}
    after = apps.read_namespaced_daemon_set("tidal-agent", namespace).spec.template.metadata.annotations
    assert after["checksum/config"] != before
    # a wrong value never reaches the cluster
    refused = helm("upgrade", "tidal", CHART, "--namespace", namespace, "--reuse-values",
                   "--set", "agent.config.period=0", check=False)
    assert refused.returncode != 0 and "/agent/config/period" in refused.stderr
    assert "helm.sh/chart" not in (after or {})
    status = helm("status", "tidal", "--namespace", namespace).stdout
    assert "REVISION: 2" in status and "STATUS: deployed" in status

    helm("uninstall", "tidal", "--namespace", namespace)
    wait_for(lambda: not apps.list_namespaced_daemon_set(namespace).items, "the DaemonSet removed")
    assert not core.list_namespaced_config_map(namespace, label_selector="app.kubernetes.io/name=tidal-agent").items

"""The Helm chart (deploy/helm/tidal) with the real helm (helm.sh/helm/v3, built by scripts/helm.sh and
cached outside the repository): it lints, its values schema refuses wrong values with their path, the
plain manifests of deploy/ are what it renders (one source), and its versions are the release's. The
chart on a real API server: tests/k8s/test_chart.py; on a real node: the node tier installs it."""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tidal"


@pytest.fixture(scope="module")
def helm():
    done = subprocess.run(["sh", str(ROOT / "scripts" / "helm.sh")], capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        pytest.fail(f"no helm: {done.stderr.strip()[-500:]} (scripts/helm.sh builds it with the Go toolchain)")
    return done.stdout.strip()


def template(helm, *args, check=True):
    done = subprocess.run([helm, "template", "tidal", str(CHART), "--namespace", "tidal-system", *args],
                          capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def test_the_chart_lints(helm):
    done = subprocess.run([helm, "lint", str(CHART), "--strict"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 chart(s) linted, 0 chart(s) failed" in done.stdout, done.stdout + done.stderr


def test_the_chart_is_the_release(helm):
    version = re.search(r'^version = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version
    images = {c["image"] for doc in yaml.safe_load_all(template(helm).stdout) if doc and doc["kind"] in
              ("DaemonSet", "Deployment") for c in doc["spec"]["template"]["spec"]["containers"]}
    assert images == {f"tidal:{version}"}


def test_the_manifests_of_deploy_are_what_the_chart_renders(helm, tmp_path):
    done = subprocess.run(["sh", str(ROOT / "scripts" / "render-manifests.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rendered = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.yaml"))
    assert rendered == ["agent-daemonset.yaml", "crd-noderesourcetopology.yaml", "crd-nodeusage.yaml",
                        "crd-podgroup.yaml", "crd-tidalpolicy.yaml", "extender.yaml", "metrics.yaml",
                        "monitoring/prometheus-rule.yaml", "rbac.yaml", "scheduler.yaml"]
    stale = [name for name in rendered if not filecmp.cmp(tmp_path / name, ROOT / "deploy" / name, shallow=False)]
    assert not stale, f"deploy/ is not what the chart renders: {stale}; run `make manifests`"


@pytest.mark.parametrize("args, path", [
    (["--set", "agent.config.period=0"], "/agent/config/period"),
    (["--set", "agent.config.perod=1"], "perod"),
    (["--set-string", "agent.config.no-resize=yes"], "/agent/config/no-resize"),
    (["--set", "agent.config.reserved-cpus=0"], "/agent/config/reserved-cpus"),  # a cpu list is text: quote it
    (["--set", "agent.config.topology-policy=numa"], "/agent/config/topology-policy"),
    (["--set", "extender.policy=random"], "/extender/policy"),
    (["--set", "lending.threshold=2"], "/lending/threshold"),
    (["--set", "metrics.staleAfter=0"], "/metrics/staleAfter"),
    (["--set", "imag.tag=x"], "imag"),
], ids=lambda v: v[-1] if isinstance(v, list) else None)
def test_a_wrong_value_is_refused_with_its_path(helm, args, path):
    done = template(helm, *args, check=False)
    assert done.returncode != 0 and "values don't meet the specifications of the schema" in done.stderr, done.stderr
    assert path in done.stderr, done.stderr


def test_the_metrics_api_is_off_unless_asked_for_and_serves_as_the_values_say(helm):
    off = [d for d in yaml.safe_load_all(template(helm).stdout) if d]
    assert not [d for d in off if d["kind"] == "APIService" or "tidal-metrics" in d["metadata"]["name"]]
    on = [d for d in yaml.safe_load_all(template(helm, "--set", "metrics.enabled=true", "--set",
                                                 "metrics.staleAfter=90").stdout) if d]
    service = next(d for d in on if d["kind"] == "APIService")
    assert service["metadata"]["name"] == "v1beta1.metrics.k8s.io" and \
        service["spec"]["service"] == {"name": "tidal-metrics", "namespace": "tidal-system", "port": 443}
    deployment = next(d for d in on if d["kind"] == "Deployment" and d["metadata"]["name"] == "tidal-metrics")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["tidal", "cluster", "metrics"] and command[command.index("--stale-after") + 1] == "90"
    assert "--insecure" not in command  # the front proxy's certificate required, as shipped
    role = next(d for d in on if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "tidal-metrics")
    assert role["rules"][0] == {"apiGroups": ["tidal.io"], "resources": ["nodeusages"], "verbs": ["get", "list", "watch"]}


def test_values_reach_the_objects(helm):
    docs = [d for d in yaml.safe_load_all(template(
        helm, "--set-string", "agent.config.reserved-cpus=0", "--set", "agent.config.memory-pressure-threshold=30",
        "--set", "agent.nodeSelector.tidal\\.io/pool=batch", "--set", "extender.enabled=false",
        "--set", "agent.nri.enabled=false", "--set", "monitoring.dashboard.enabled=true",
        "--set", "scheduler.enabled=false", "--set", "image.tag=0.2.0-rc1").stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert "Service" not in kinds and kinds.count("Deployment") == 1  # the lending controller alone
    config = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] ==
                                 "tidal-agent-config")["data"]["agent.yaml"])
    assert config["reserved-cpus"] == "0" and config["memory-pressure-threshold"] == 30
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert daemonset["nodeSelector"] == {"tidal.io/pool": "batch"}
    assert [c["name"] for c in daemonset["containers"]] == ["agent"]
    assert daemonset["containers"][0]["image"] == "tidal:0.2.0-rc1"
    deployment = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in deployment["containers"]] == ["lending"] and "volumes" not in deployment
    dashboard = next(d for d in docs if d["metadata"]["name"] == "tidal-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["tidal.json"])["uid"] == "tidal-node"
    assert not [d for d in docs if "tidal-scheduler" in d["metadata"]["name"]]  # scheduler.enabled=false: none of it
    scheduler = [d for d in yaml.safe_load_all(template(
        helm, "--set", "scheduler.shards=2", "--set", "scheduler.name=batch-scheduler").stdout)
        if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "tidal-scheduler"][0]
    command = scheduler["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["tidal", "cluster", "scheduler"] and scheduler["spec"]["replicas"] == 2
    assert command[command.index("--shards") + 1] == "2" and command[command.index("--scheduler-name") + 1] == \
        "batch-scheduler"
    assert command[command.index("--pod-initial-backoff") + 1] == "1" and \
        command[command.index("--pod-max-backoff") + 1] == "10"
    # the config file the chart writes is one the agent takes (every key a flag, every value its type)
    from click.testing import CliRunner

    from agent.cli import main

    path = ROOT / ".pytest-chart-agent.yaml"
    try:
        path.write_text(yaml.safe_dump(config))
        result = CliRunner().invoke(main, ["agent", "--config", str(path), "--print-config", "json"])
    finally:
        os.unlink(path)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["values"]["reserved-cpus"] == {"value": "0", "source": "file"}

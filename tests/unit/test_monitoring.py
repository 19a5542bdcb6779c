"""What ships for monitoring (the chart's files/: the alerting rules and the Grafana dashboard; rendered
into deploy/monitoring too) reads what the agent exports.

* Every metric a rule or a dashboard panel names is one a live agent serves on /metrics (its families,
  as Prometheus names their series: a counter's ``_total``); ``up`` is Prometheus' own.
* The rules pass ``promtool check rules`` and promtool's unit tests (tests/monitoring/rules-test.yaml):
  each alert fires on the series that call for it and not on a healthy node.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List, Set

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agent.client import _UnixConnection
from agent.topology.synthetic import Shape, write_tree

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "helm" / "tidal" / "files" / "prometheus-rules.yaml"  # a Prometheus rule file
DASHBOARD = ROOT / "deploy" / "helm" / "tidal" / "files" / "grafana-dashboard.json"
PROMETHEUS_OWN = {"up"}
SERIES = {"counter": ("_total",), "gauge": ("",), "summary": ("_sum", "_count", ""), "histogram": ("_bucket", "_sum", "_count"),
          "info": ("_info",), "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "unknown": ("",)}


def rule_exprs() -> List[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs(dashboard: dict) -> List[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] if isinstance(v.get("query"), dict) else v["query"]
              for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def unknown_names(exprs: Iterable[str], exposed: Set[str]) -> List[str]:
    """Metric names in ``exprs`` that are not exposed; an expression naming no Tidal metric at all too."""
    bad = []
    for expr in exprs:
        names = set(re.findall(r"\btidal_[a-z0-9_]+", expr))
        if not names and not any(re.search(rf"\b{n}\b", expr) for n in PROMETHEUS_OWN):
            bad.append(f"names no metric: {expr}")
        bad += [f"{name} (in {expr!r})" for name in sorted(names - exposed)]
    return bad


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> Set[str]:
    """The series names a live agent (the CLI's, on a captured tree, cgroups recorded) serves."""
    tmp = tmp_path_factory.mktemp("metrics")
    write_tree(str(tmp / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    sock = tmp / "m.sock"
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--root", str(tmp / "root"), "--cgroups-in-memory",
                             "--socket", str(sock), "--state-dir", str(tmp / "state")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc.stdout.readline(), proc.stdout.readline()  # cgroups in memory; the node
        assert "serving" in proc.stdout.readline()
        conn = _UnixConnection(str(sock), 15)
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 200
        text = response.read().decode()
        conn.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SERIES[family.type]}
    assert len(names) >= 35, sorted(names)  # the families the agent describes (37 now)
    return names


def test_every_metric_the_rules_name_is_served(exposed):
    assert len(rule_exprs()) >= 8
    assert unknown_names(rule_exprs(), exposed) == []


def test_every_metric_the_dashboard_names_is_served(exposed):
    dashboard = json.loads(DASHBOARD.read_text())
    assert len(dashboard["panels"]) >= 12
    assert unknown_names(dashboard_exprs(dashboard), exposed) == []


def test_a_dashboard_naming_a_metric_that_does_not_exist_fails(exposed):
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][2]["targets"][0]["expr"] = 'sum(tidal_pool_cpu{instance=~"$instance"})'  # one letter off
    assert unknown_names(dashboard_exprs(dashboard), exposed) == \
        ['tidal_pool_cpu (in \'sum(tidal_pool_cpu{instance=~"$instance"})\')']
    assert unknown_names(["rate(node_cpu_seconds_total[5m])"], exposed) == \
        ["names no metric: rate(node_cpu_seconds_total[5m])"]


def test_the_rules_pass_promtool_and_its_unit_tests(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no promtool: `make deps` installs Debian's prometheus package (scripts/debian-packages.txt)")
    spec = yaml.safe_load(RULES.read_text())
    shutil.copy(RULES, tmp_path / "rules.yml")
    shutil.copy(ROOT / "tests" / "monitoring" / "rules-test.yaml", tmp_path)
    check = subprocess.run([promtool, "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0 and f"SUCCESS: {len(rule_exprs())} rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", "rules-test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr
    # the unit tests cover every alert
    tested = set(re.findall(r"alertname: (\w+)", (tmp_path / "rules-test.yaml").read_text()))
    assert tested == {rule["alert"] for group in spec["groups"] for rule in group["rules"]}

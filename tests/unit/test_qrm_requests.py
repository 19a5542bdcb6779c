"""Request parsing (Tidal and Katalyst vocabularies) and `tidal plan`, including bad input."""

import json
import re

import pytest
from click.testing import CliRunner

from agent.cli import main
from agent.errors import AdmissionError
from agent.qrm.model import QoS, Tier
from agent.qrm.requests import parse_request, parse_requests
from agent.topology.synthetic import FakeNic, Shape, write_tree


@pytest.mark.parametrize("doc,expected", [
    ({"name": "web", "qos": "dedicated_cores", "cpus": 4, "numa_binding": True},
     dict(qos=QoS.DEDICATED, cpus=4, millicpu=4000, numa_binding=True)),
    ({"name": "d", "qos": "dedicated_cores", "millicpu": 2000}, dict(qos=QoS.DEDICATED, cpus=2)),
    ({"name": "api", "qos": "shared_cores", "millicpu": 1500}, dict(qos=QoS.SHARED, millicpu=1500)),
    ({"name": "api", "qos": "shared_cores", "cpus": 0.5}, dict(qos=QoS.SHARED, millicpu=500)),
    ({"name": "b", "qos": "reclaimed_cores", "millicpu": 2000, "tier": "min"},
     dict(qos=QoS.RECLAIMED, millicpu=2000, tier=Tier.MIN)),
    ({"name": "s", "qos": "system_cores"}, dict(qos=QoS.SYSTEM)),
    ({"name": "k", "katalyst.kubewharf.io/qos_level": "dedicated_cores", "cpus": 2,
      "memory_enhancement": json.dumps({"numa_binding": "true", "numa_exclusive": "true"})},
     dict(qos=QoS.DEDICATED, numa_binding=True, numa_exclusive=True)),
    ({"name": "k2", "katalyst.kubewharf.io/qos_level": "dedicated_cores", "cpus": 2,
      "cpu_enhancement": {"numa_binding": True}}, dict(numa_binding=True, numa_exclusive=False)),
    ({"name": "x", "qos": "dedicated_cores", "cpus": 2, "numa_exclusive": True},
     dict(numa_binding=True, numa_exclusive=True)),
], ids=["dedicated", "dedicated-millicpu", "shared", "shared-cpus", "reclaimed-tier", "system",
        "katalyst-annotation", "katalyst-object", "exclusive-implies-binding"])
def test_parse_request(doc, expected):
    request = parse_request(doc)
    for key, value in expected.items():
        assert getattr(request, key) == value


@pytest.mark.parametrize("doc,message", [
    ({"name": "a", "qos": "gold_cores", "cpus": 1}, "unknown qos 'gold_cores'"),
    ({"name": "a", "qos": "dedicated_cores", "cpus": 0}, "cpus must be positive"),
    ({"name": "a", "qos": "dedicated_cores", "cpus": -2}, "cpus must be positive"),
    ({"name": "a", "qos": "dedicated_cores", "cpus": 1.5}, "needs whole cpus"),
    ({"name": "a", "qos": "dedicated_cores", "millicpu": 1500}, "needs whole cpus"),
    ({"name": "a", "qos": "dedicated_cores"}, "needs cpus"),
    ({"name": "a", "qos": "shared_cores", "millicpu": "lots"}, "must be a number"),
    ({"name": "a", "qos": "shared_cores"}, "needs millicpu"),
    ({"name": "a", "qos": "reclaimed_cores", "millicpu": 1, "tier": "gold"}, "unknown tier"),
    ({"name": "a", "qos": "shared_cores", "millicpu": 1, "tier": "low"}, "tier applies to reclaimed_cores"),
    ({"name": "a", "qos": "shared_cores", "millicpu": 1, "numa_binding": True}, "applies to dedicated_cores"),
    ({"name": "a", "qos": "dedicated_cores", "cpus": 1, "numa_binding": "yes"}, "must be true or false"),
    ({"name": "a", "qos": "dedicated_cores", "cpus": 1, "memory_enhancement": "{"}, "is not JSON"),
    ({"name": "", "qos": "shared_cores", "millicpu": 1}, "request name"),
    ({"name": "a/b", "qos": "shared_cores", "millicpu": 1}, "request name"),
    ({"qos": "shared_cores", "millicpu": 1}, "request name"),
    ({"name": "a", "millicpu": 1}, "missing qos"),
    ({"name": "a", "qos": "shared_cores", "millicpu": 1, "colour": "red"}, "unknown field(s) colour"),
    ([1, 2], "must be a JSON object"),
], ids=["unknown-qos", "zero", "negative", "fractional", "fractional-millicpu", "no-size", "not-number",
        "no-millicpu", "unknown-tier", "tier-on-shared", "binding-on-shared", "bad-flag", "bad-enhancement",
        "empty-name", "slash-name", "no-name", "no-qos", "unknown-field", "not-object"])
def test_bad_requests(doc, message):
    with pytest.raises(AdmissionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_request(doc)


def test_malformed_json_names_line_and_column():
    with pytest.raises(AdmissionError, match=r"r.json: malformed JSON: line 2 column"):
        parse_requests('[\n{"name": ]', "r.json")
    with pytest.raises(AdmissionError, match="expected a JSON list"):
        parse_requests('{"name": "a"}', "r.json")
    with pytest.raises(AdmissionError, match="item 1: request 'b': unknown qos"):
        parse_requests('[{"name": "a", "qos": "shared_cores", "millicpu": 1}, {"name": "b", "qos": "x"}]', "r.json")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan")
    write_tree(str(path), Shape(gpus=(0, 1, 2, 3), nics=(FakeNic("eth0", 3),)))
    return str(path)


def plan(root, tmp_path, docs, *extra):
    requests = tmp_path / "requests.json"
    requests.write_text(docs if isinstance(docs, str) else json.dumps(docs))
    return CliRunner().invoke(main, ["plan", "--root", root, "--requests", str(requests), *extra])


def test_plan_json(root, tmp_path):
    result = plan(root, tmp_path, [
        {"name": "web", "qos": "dedicated_cores", "cpus": 4, "numa_binding": True},
        {"name": "api", "qos": "shared_cores", "millicpu": 1500},
        {"name": "batch", "qos": "reclaimed_cores", "millicpu": 2000},
        {"name": "gpu", "qos": "dedicated_cores", "cpus": 2, "gpus": 2},
        {"name": "net", "qos": "dedicated_cores", "cpus": 2, "nic": "eth0"},
    ], "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    by_name = {a["name"]: a for a in out["assignments"]}
    assert set(out) == {"assignments", "pools", "rejected"} and out["rejected"] == []
    assert set(out["pools"]) >= {"reserved", "shared", "reclaimed"}
    assert out["pools"]["reserved"] == [0, 32]  # first physical core, both threads
    web = by_name["web"]
    assert len(web["cpus"]) == 4 and web["mems"] == [0] and all(c % 32 < 8 for c in web["cpus"])
    assert by_name["api"]["cpus"] == out["pools"]["shared"] and len(out["pools"]["shared"]) >= 2
    assert by_name["batch"]["cpus"] == out["pools"]["reclaimed"] and by_name["batch"]["tier"] == "low"
    assert len(by_name["gpu"]["gpus"]) == 2
    gpu_numa = {f"0000:{0x10 + i:02x}:00.0": i for i in range(4)}  # one GPU per NUMA node
    assert {c % 32 // 8 for c in by_name["gpu"]["cpus"]} <= {gpu_numa[g] for g in by_name["gpu"]["gpus"]}
    assert all(24 <= c % 32 < 32 for c in by_name["net"]["cpus"])  # eth0 sits on NUMA node 3


def test_plan_rejections_leave_state_unchanged(root, tmp_path):
    docs = [
        {"name": "a", "qos": "dedicated_cores", "cpus": 4},
        {"name": "a", "qos": "dedicated_cores", "cpus": 2},
        {"name": "huge", "qos": "dedicated_cores", "cpus": 1000},
        {"name": "b", "qos": "dedicated_cores", "cpus": 2},
    ]
    result = plan(root, tmp_path, docs, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [r["name"] for r in out["rejected"]] == ["a", "huge"]
    assert "already in use" in out["rejected"][0]["reason"]
    assert "asks 1000 cpus; the node has 62 cpus outside the reserved pool" == out["rejected"][1]["reason"]
    alone = json.loads(plan(root, tmp_path, [docs[0], docs[3]], "--json").output)
    assert out["assignments"] == alone["assignments"] and out["pools"] == alone["pools"]


def test_plan_table_has_core_map(root, tmp_path):
    result = plan(root, tmp_path, [{"name": "web", "qos": "dedicated_cores", "cpus": 4}])
    assert result.exit_code == 0, result.output
    assert re.search(r"^web +dedicated_cores +1-2,33-34 ", result.output, re.M)
    assert "numa   0: RR aa aa CC CC" in result.output  # no shared request: everything else is lent
    assert "a=web" in result.output


@pytest.mark.parametrize("docs,args,message", [
    ("[{", (), "malformed JSON"),
    ([{"name": "a", "qos": "nope"}], (), "unknown qos"),
    ([{"name": "a", "qos": "dedicated_cores", "cpus": 0}], (), "cpus must be positive"),
    ([], ("--reserved-cpus", "0-x"), "--reserved-cpus: not a cpu list"),
    ([], ("--reserved-cpus", "500"), "reserved cpus 500 are not online"),
    ([], ("--reserved-cpus", "0-63"), "leave no cpu for workloads"),
], ids=["malformed-json", "unknown-qos", "zero-cpus", "bad-reserved", "reserved-offline", "reserved-all"])
def test_plan_bad_input_is_one_error_line(root, tmp_path, docs, args, message):
    result = plan(root, tmp_path, docs, *args)
    assert result.exit_code == 2
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("tidal: error: ") and message in lines[0], result.output


def test_bench_qrm_json_shape():
    result = CliRunner().invoke(main, ["bench", "qrm", "--workloads", "60", "--repeat", "2",
                                       "--churn-steps", "200", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) >= {"decision_p99_ms", "reload_ms", "fit_after_churn"}
    assert out["decision_p99_ms"] > 0 and out["reload_ms"] > 0
    assert set(out["fit_after_churn"]) >= {"tidal", "first_fit"}
    assert out["admitted"] == 60

"""Each pod's use from its node's agent to the HorizontalPodAutoscaler: the agent's NodeUsage report
(``agent.reporter.pod_usage``, ``KubeNodeAgent.publish_usage``), its contract (``contracts.nodeusage``) and
``tidal cluster metrics`` serving it as ``metrics.k8s.io`` (``cluster.podmetrics``). A real API server,
kubelet, HPA and the agent's DaemonSet run it in tests/node/test_pod_metrics.py."""

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from agent.isolation.cgroups.recording import RecordingCgroups
from agent.k8s.node import KubeNodeAgent
from agent.reporter.pod_usage import PodUsageMeter, node_counters
from cluster.podmetrics import TidalMetrics, name_check, require_front_proxy, tls_context
from contracts import nodeusage
from contracts.pods import pod_request
from tests.unit.test_k8s_unit import FakeRest, _NoApi, pod, pod_agent

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)
BASE = "/apis/metrics.k8s.io/v1beta1"


def usage_object(node="n1", when=NOW, window=15.0, pods=None):
    pods = pods if pods is not None else [nodeusage.PodUsage("web", "web-a", "uid-a", (
        nodeusage.ContainerUsage("app", 730, 50 << 20), nodeusage.ContainerUsage("side", 20, 8 << 20)))]
    return nodeusage.document(node, when, window, 1500, 3 << 30, pods)


def pod_object(name="web-a", uid="uid-a", namespace="web", labels=None):
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": labels or {"app": "web"}}}


# ---- the contract ---------------------------------------------------------------------------
def test_a_report_reads_back_as_written():
    read = nodeusage.parse(json.loads(json.dumps(usage_object())))
    assert read.node == "n1" and read.timestamp == NOW and read.window_s == 15.0
    assert (read.millicpu, read.memory_bytes) == (1500, 3 << 30)
    assert read.pods[0].containers == (nodeusage.ContainerUsage("app", 730, 50 << 20),
                                       nodeusage.ContainerUsage("side", 20, 8 << 20))


@pytest.mark.parametrize("change, where", [
    (lambda o: o.pop("usage"), "usage: missing"),
    (lambda o: o["usage"].update(timestamp="yesterday"), "usage.timestamp"),
    (lambda o: o["usage"].update(windowSeconds=0), "usage.windowSeconds"),
    (lambda o: o["usage"].update(windowSeconds=True), "usage.windowSeconds"),
    (lambda o: o["usage"].update(pods={}), "usage.pods: not a list"),
    (lambda o: o["usage"]["pods"][0]["containers"][0].update(cpu=-1), "containers[0].cpu"),
    (lambda o: o["usage"]["pods"][0]["containers"][0].update(cpu=1 << 50), "containers[0].cpu"),
    (lambda o: o["usage"]["pods"][0]["containers"][1].update(memory="8Mi"), "containers[1].memory"),
    (lambda o: o["usage"]["pods"][0]["containers"].append(7), "containers[2]: not an object"),
    (lambda o: o["usage"]["pods"][0].update(uid=""), "uid"),
    (lambda o: o["usage"]["node"].update(cpu=1.5), "usage.node.cpu"),
])
def test_a_report_that_is_not_one_is_refused_with_the_field_named(change, where):
    obj = usage_object()
    change(obj)
    with pytest.raises(ValueError, match=where.replace("[", r"\[").replace("]", r"\]")):
        nodeusage.parse(obj)


# ---- the agent's measure ----------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_meter_shows_a_rate_from_the_second_read_and_starts_over_when_a_counter_goes_back():
    cgroups, clock = RecordingCgroups(), Clock()
    node = {"busy": 0}
    meter = PodUsageMeter(cgroups, node=lambda: (node["busy"], 2 << 30), clock=clock)
    cgroups.usage["kubepods/podu/c1"], cgroups.memory["kubepods/podu/c1"] = 5_000_000_000, 64 << 20
    pods = [("web", "web-a", "u", [("app", "kubepods/podu/c1")])]
    assert meter.measure(pods) == [] and meter.window_s is None  # a rate needs two reads
    clock.now += 10
    cgroups.usage["kubepods/podu/c1"] += 2_500_000_000  # 2.5 cpu-seconds in 10 s
    node["busy"] += 12_000_000_000
    got = meter.measure(pods)
    assert got == [nodeusage.PodUsage("web", "web-a", "u", (nodeusage.ContainerUsage("app", 250, 64 << 20),))]
    assert meter.window_s == 10 and meter.node_millicpu == 1200 and meter.node_bytes == 2 << 30
    clock.now += 10
    cgroups.usage["kubepods/podu/c1"] = 1_000  # restarted under the same cgroup: no figure, not a negative one
    assert meter.measure(pods) == []
    clock.now += 10
    cgroups.usage["kubepods/podu/c1"] += 1_000_000_000
    assert meter.measure(pods)[0].containers[0].millicpu == 100
    meter.measure([])  # the pod gone: its counter forgotten
    assert set(meter._last) == {""}


def test_the_nodes_counters_are_read_from_proc(tmp_path):
    (tmp_path / "stat").write_text("cpu  100 5 50 1000 20 3 2 7 4 0\ncpu0 1 1 1 1 1 1 1 1 1 1\n")
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n")
    import os

    tick = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    assert node_counters(str(tmp_path)) == ((100 + 5 + 50 + 3 + 2) * tick, 600 * 1024)
    assert node_counters(str(tmp_path / "missing")) == (None, None)


def test_the_node_agent_reports_each_running_containers_use_under_its_pods_name(topo_dual_socket_ht, tmp_path,
                                                                               make_agent):
    from kube.rest import ApiError

    cgroups = RecordingCgroups()
    cgroups.create("kubepods")
    agent = pod_agent(topo_dual_socket_ht, make_agent, cgroups)
    node = KubeNodeAgent(agent, _NoApi(), "n1")
    spec = pod(name="web-a", cpu="500m", limits=False, uid="u-web")
    spec["metadata"]["namespace"] = "web"
    spec["status"] = {"qosClass": "Burstable", "containerStatuses": [
        {"name": "app", "containerID": "containerd://aaa", "state": {"running": {}}},
        {"name": "done", "containerID": "containerd://bbb", "state": {"terminated": {}}}]}
    for path in ("kubepods/burstable/podu-web", "kubepods/burstable/podu-web/aaa"):
        cgroups.create(path)
    cgroups.usage["kubepods/burstable/podu-web/aaa"], cgroups.memory["kubepods/burstable/podu-web/aaa"] = 0, 7 << 20
    node.on_pod(spec)
    assert node.pods["u-web"].workload == pod_request(spec).workload
    # a pod the agent refused (more whole cpus than the node has) still runs under the kubelet: measured too
    big = pod(name="big", cpu="999", uid="u-big")
    big["status"] = {"qosClass": "Guaranteed", "containerStatuses": [
        {"name": "app", "containerID": "containerd://ccc", "state": {"running": {}}}]}
    cgroups.create("kubepods/podu-big/ccc")
    cgroups.usage["kubepods/podu-big/ccc"], cgroups.memory["kubepods/podu-big/ccc"] = 0, 1 << 20
    node.on_pod(big)
    assert "u-big" in node.refused
    clock = Clock()
    node.usage_meter.clock, node.usage_meter.node = clock, lambda: (0, 1 << 30)
    applied = "PATCH", "/apis/tidal.io/v1alpha1/nodeusages/n1?fieldManager=tidal-agent&force=true"
    node.rest = FakeRest()
    assert node.publish_usage() is False and node.rest.calls == []  # the first read primes the rates
    clock.now += 15
    cgroups.usage["kubepods/burstable/podu-web/aaa"] = 6_000_000_000  # 6 cpu-seconds in 15 s
    cgroups.usage["kubepods/podu-big/ccc"] = 15_000_000_000
    assert node.publish_usage() is True
    method, path, body, content = node.rest.calls[0]
    assert (method, path, content) == (*applied, "application/apply-patch+yaml")
    read = nodeusage.parse(body)
    assert read.window_s == 15 and set(read.pods) == {
        nodeusage.PodUsage("web", "web-a", "u-web", (nodeusage.ContainerUsage("app", 400, 7 << 20),)),
        nodeusage.PodUsage("ns", "big", "u-big", (nodeusage.ContainerUsage("app", 1000, 1 << 20),))}
    node.rest = FakeRest({applied: ApiError(404, *applied, b"the server could not find the requested resource")})
    # the CRD not installed
    clock.now += 15
    assert node.publish_usage() is False and "kubectl apply -f deploy/crd-nodeusage.yaml" in node.usage_off
    node.rest = FakeRest()  # installed since: reported again, the warning over
    clock.now += 15
    assert node.publish_usage() is True and node.usage_off is None
    node.rest = FakeRest({applied: ApiError(500, *applied, b"boom")})
    clock.now += 15
    with pytest.raises(ApiError):  # anything else: counted by the report loop, tried again next period
        node.publish_usage()


# ---- the metrics API ------------------------------------------------------------------------------
def served(now=NOW):
    metrics = TidalMetrics(stale_after=60, clock=lambda: now)
    metrics.on_usage_list([usage_object(), usage_object("n2", pods=[nodeusage.PodUsage(
        "batch", "job-1", "uid-j", (nodeusage.ContainerUsage("work", 1000, 1 << 30),))])])
    metrics.on_pod_list([pod_object(), pod_object("job-1", "uid-j", "batch", {"app": "job"})])
    return metrics


def test_pods_are_served_with_their_labels_window_and_the_sum_of_their_containers():
    metrics = served()
    code, body = metrics.answer("GET", f"{BASE}/namespaces/web/pods?labelSelector=app%3Dweb")
    assert code == 200 and body["kind"] == "PodMetricsList"
    (item,) = body["items"]
    assert item["metadata"]["name"] == "web-a" and item["metadata"]["labels"] == {"app": "web"}
    assert item["timestamp"] == "2026-11-29T12:00:00.000000Z" and item["window"] == "15000ms"
    assert item["containers"] == [{"name": "app", "usage": {"cpu": "730m", "memory": f"{50 << 10}Ki"}},
                                  {"name": "side", "usage": {"cpu": "20m", "memory": f"{8 << 10}Ki"}}]
    assert [i["metadata"]["name"] for i in metrics.answer("GET", f"{BASE}/pods")[1]["items"]] == ["job-1", "web-a"]
    assert metrics.answer("GET", f"{BASE}/namespaces/web/pods?labelSelector=app%3Djob")[1]["items"] == []
    assert metrics.answer("GET", f"{BASE}/namespaces/batch/pods/job-1")[1]["kind"] == "PodMetrics"
    assert metrics.answer("GET", f"{BASE}/namespaces/web/pods/job-1")[0] == 404


def test_nodes_are_served_and_a_node_selector_is_refused():
    metrics = served()
    body = metrics.answer("GET", f"{BASE}/nodes")[1]
    assert [(i["metadata"]["name"], i["usage"]["cpu"]) for i in body["items"]] == [("n1", "1500m"), ("n2", "1500m")]
    assert metrics.answer("GET", f"{BASE}/nodes/n2")[1]["usage"]["memory"] == f"{3 << 20}Ki"
    assert metrics.answer("GET", f"{BASE}/nodes/n3")[0] == 404
    code, body = metrics.answer("GET", f"{BASE}/nodes?labelSelector=zone%3Da")
    assert code == 400 and "not served" in body["message"]


def test_a_pod_made_again_under_its_name_a_stale_report_and_a_corrupt_one_are_not_served():
    metrics = served()
    metrics.on_pod("MODIFIED", pod_object(uid="uid-a2"))  # deleted and made again: the report is the old pod's
    assert metrics.answer("GET", f"{BASE}/namespaces/web/pods")[1]["items"] == []
    metrics.on_pod("DELETED", pod_object(uid="uid-a"))  # the old one's deletion does not take the new one away
    assert metrics._pods[("web", "web-a")][0] == "uid-a2"
    later = served(NOW + timedelta(seconds=61))  # no report for a minute: the agent is gone
    assert later.answer("GET", f"{BASE}/pods")[1]["items"] == [] and later.answer("GET", f"{BASE}/nodes")[1]["items"] == []
    bad = usage_object()
    bad["usage"]["windowSeconds"] = -3
    metrics.on_usage("MODIFIED", bad)
    assert "windowSeconds" in metrics.refused["n1"] and [i["metadata"]["name"] for i in
                                                          metrics.answer("GET", f"{BASE}/nodes")[1]["items"]] == ["n2"]
    metrics.on_usage("DELETED", usage_object("n2"))
    assert metrics.answer("GET", f"{BASE}/nodes")[1]["items"] == []


def _certs(d):
    def run(*argv):
        subprocess.run(list(argv), check=True, capture_output=True, cwd=d)

    for ca in ("proxy-ca", "other-ca"):
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={ca}",
            "-keyout", f"{ca}.key", "-out", f"{ca}.crt")
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", "tls.key", "-out", "tls.crt")
    for name, ca in (("front-proxy-client", "proxy-ca"), ("someone", "proxy-ca"), ("front-proxy-client", "other-ca")):
        base = f"{name}-{ca}"
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{base}.key",
            "-out", f"{base}.csr")
        run("openssl", "x509", "-req", "-in", f"{base}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-days", "1", "-out", f"{base}.crt")


def test_only_the_api_servers_front_proxy_is_answered_over_https(tmp_path, capfd):
    _certs(tmp_path)
    metrics = served(datetime.now(timezone.utc))
    metrics.on_usage_list([usage_object(when=datetime.now(timezone.utc))])
    context = tls_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    require_front_proxy(context, (tmp_path / "proxy-ca.crt").read_text())
    port = metrics.serve(context, authorize=name_check(["front-proxy-client"]))

    def get(path, client=None):
        context = ssl.create_default_context(cafile=str(tmp_path / "tls.crt"))
        if client:
            context.load_cert_chain(str(tmp_path / f"{client}.crt"), str(tmp_path / f"{client}.key"))
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=context, timeout=10) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    try:
        code, body = get(f"{BASE}/namespaces/web/pods", "front-proxy-client-proxy-ca")
        assert code == 200 and body["items"][0]["metadata"]["name"] == "web-a"
        assert get(f"{BASE}/pods")[0] == 401  # no certificate
        assert get("/readyz") == (200, {"status": "ok"})  # the kubelet's probe has none
        code, body = get(f"{BASE}/pods", "someone-proxy-ca")  # the right CA, not the front proxy's name
        assert code == 401 and "front-proxy-client" in body["message"]
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            get(f"{BASE}/pods", "front-proxy-client-other-ca")  # another CA: the handshake is refused
        request = urllib.request.Request(f"https://127.0.0.1:{port}{BASE}/pods", method="POST", data=b"{}")
        context = ssl.create_default_context(cafile=str(tmp_path / "tls.crt"))
        context.load_cert_chain(str(tmp_path / "front-proxy-client-proxy-ca.crt"),
                                str(tmp_path / "front-proxy-client-proxy-ca.key"))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, context=context, timeout=10)
        assert refused.value.code == 405 and json.load(refused.value)["kind"] == "Status"
    finally:
        metrics.stop()
    assert "Traceback" not in capfd.readouterr().err  # a refused handshake is no traceback on stderr


def test_a_silent_caller_is_dropped_and_others_are_served_meanwhile(tmp_path):
    import socket
    import time

    _certs(tmp_path)
    metrics = served(datetime.now(timezone.utc))
    port = metrics.serve(tls_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")), io_timeout=0.5)
    try:
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]  # no handshake, nothing sent
        context = ssl.create_default_context(cafile=str(tmp_path / "tls.crt"))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=context, timeout=5) as answer:
            assert answer.status == 200
        time.sleep(1.0)
        for sock in silent:
            sock.settimeout(5)
            assert sock.recv(1) == b""  # closed by the server
            sock.close()
    finally:
        metrics.stop()


@pytest.mark.parametrize("token", ["bearer tok-123", "Bearer tok-123", "tok-123"],
                         ids=["in-cluster", "kubeconfig", "bare"])
def test_the_lean_client_sends_the_token_however_the_loader_spelled_it(token):
    """The in-cluster loader keeps the service account's token as ``bearer <t>``: the lean client (the metrics
    server's and the scheduler's watches) sent ``Bearer bearer <t>`` in a pod, and every call was a 401."""
    from kubernetes.client import Configuration

    from kube.rest import Rest

    config = Configuration()
    config.host = "https://10.0.0.1:443"
    config.api_key = {"authorization": token}
    rest = Rest.from_config(config)
    assert rest.headers["Authorization"] == "Bearer tok-123" and (rest.host, rest.port) == ("10.0.0.1", 443)

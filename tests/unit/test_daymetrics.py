"""``cluster.daymetrics``: the resource metrics API a compressed day's HorizontalPodAutoscaler reads (the HPA
itself runs on a real control plane in tests/k8s/test_day.py), and the simulator's model of the HPA."""

import json
import ssl
import subprocess
import urllib.request

import numpy as np
import pytest

from cluster.day import controllers, compare_replicas, hpa_window, in_day_window
from cluster.daymetrics import APISERVICE, DayMetrics, hpa, parse_selector
from cluster.simulate import SimConfig, _replicas

LABELS = {"app": "web", "tidal.io/day": "online"}


def test_the_selector_an_hpa_sends_is_read_and_anything_else_refused():
    assert parse_selector("app=web,tidal.io/day==online") == {"app": "web", "tidal.io/day": "online"}
    assert parse_selector("") == {}
    for bad in ("app!=web", "app in (web)", "app"):
        with pytest.raises(ValueError):
            parse_selector(bad)


def test_each_serving_pod_shows_an_even_share_of_the_demand():
    metrics = DayMetrics("day", LABELS)
    metrics.update(["web-a", "web-b", "web-c"], 4.5)
    status, body = metrics.answer("GET", "/apis/metrics.k8s.io/v1beta1/namespaces/day/pods?labelSelector=app%3Dweb")
    assert status == 200 and body["kind"] == "PodMetricsList"
    assert [(i["metadata"]["name"], i["containers"][0]["usage"]["cpu"]) for i in body["items"]] == \
        [("web-a", "1500m"), ("web-b", "1500m"), ("web-c", "1500m")]
    # counted by the HPA the minute the pod serves: a window that begins after the pod became Ready
    assert body["items"][0]["window"] == "1ms" and "." in body["items"][0]["timestamp"]
    metrics.update(["web-a"], 2.0)  # the next minute: one pod left, all the demand on it
    assert metrics.answer("GET", "/apis/metrics.k8s.io/v1beta1/pods")[1]["items"][0]["containers"][0]["usage"] \
        == {"cpu": "2000m", "memory": "64Mi"}
    assert metrics.requests == 2


def test_what_is_not_the_days_pods_is_empty_or_refused():
    metrics = DayMetrics("day", LABELS)
    metrics.update(["web-a"], 1.0)
    base = "/apis/metrics.k8s.io/v1beta1"
    assert metrics.answer("GET", f"{base}/namespaces/other/pods")[1]["items"] == []
    assert metrics.answer("GET", f"{base}/namespaces/day/pods?labelSelector=app%3Ddb")[1]["items"] == []
    assert metrics.answer("GET", f"{base}/nodes")[1]["items"] == []
    assert metrics.answer("GET", f"{base}/namespaces/day/pods/web-a")[1]["kind"] == "PodMetrics"
    assert metrics.answer("GET", f"{base}/namespaces/day/pods/web-z")[0] == 404
    assert metrics.answer("GET", f"{base}/namespaces/day/pods?labelSelector=app%21%3Dweb")[0] == 400
    assert metrics.answer("POST", f"{base}/pods")[0] == 405
    assert metrics.answer("GET", "/apis/other.io/v1/things")[0] == 404
    found = metrics.answer("GET", base)[1]
    assert found["groupVersion"] == "metrics.k8s.io/v1beta1" and {r["name"] for r in found["resources"]} == {"pods", "nodes"}


def test_it_serves_https(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(tmp_path / "k"), "-out", str(tmp_path / "c")], check=True, capture_output=True)
    metrics = DayMetrics("day", LABELS)
    metrics.update(["web-a", "web-b"], 3.0)
    port = metrics.start(str(tmp_path / "c"), str(tmp_path / "k"))
    try:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        url = f"https://127.0.0.1:{port}/apis/metrics.k8s.io/v1beta1/namespaces/day/pods"
        with urllib.request.urlopen(url, context=context, timeout=10) as response:
            items = json.load(response)["items"]
        assert [i["containers"][0]["usage"]["cpu"] for i in items] == ["1500m", "1500m"]
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(f"https://127.0.0.1:{port}/nothing", context=context, timeout=10)
        assert failed.value.code == 404
    finally:
        metrics.stop()


def test_the_hpa_is_kubernetes_own_with_its_behaviour_on_the_days_clock():
    doc = hpa("day", "web", 0.6, max_replicas=45, down_window_s=1)
    assert doc["apiVersion"] == "autoscaling/v2" and doc["spec"]["maxReplicas"] == 45
    assert doc["spec"]["metrics"][0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 60}
    assert doc["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 1
    assert doc["spec"]["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert APISERVICE == "v1beta1.metrics.k8s.io"
    assert hpa_window(0.2, 5) == 1 and hpa_window(0.01, 5) == 1 and hpa_window(1.0, 5) == 5
    assert controllers(0.2)["flags"] == ("--horizontal-pod-autoscaler-sync-period=200ms",)
    assert "horizontal-pod-autoscaler-controller" in controllers()["extra"]


def test_the_simulators_hpa_holds_inside_its_tolerance_and_waits_to_scale_down():
    config = SimConfig(replica_cores=2, hpa_target=0.5, hpa_down_minutes=3, hpa_tolerance=0.1)
    # 10 replicas serve 10 cores at the target; 10.9 is within 10%: no new replica (the HPA's tolerance)
    demand = np.array([10.0, 10.9, 11.5, 11.5, 6.0, 6.0, 6.0, 6.0])
    assert list(_replicas(config, demand)) == [10, 10, 12, 12, 12, 12, 6, 6]
    # without the tolerance it is the running max of the demand's replicas over the window
    config.hpa_tolerance = 0.0
    rng = np.random.default_rng(3)
    demand = rng.uniform(1, 40, 300)
    want = np.ceil(demand / (config.replica_cores * config.hpa_target))
    assert list(_replicas(config, demand)) == [want[max(0, t - 2):t + 1].max() for t in range(300)]
    with pytest.raises(Exception):
        SimConfig(hpa_tolerance=1.5).check()


def test_replicas_compared_allow_two_hpas_their_tolerance():
    out = compare_replicas([20, 21, 22, 26, 5], [20, 20, 20, 22, 5], tolerance=0.1)
    # 21 and 22 are within 10% of 20 (2 replicas); 26 is not within 10% of 22 (3)
    assert out["minutes_apart"] == 3 and out["outside_tolerance"] == 1 and out["first_outside_tolerance"] == [3]
    assert out["apart_at"] == [[1, 21, 20], [2, 22, 20], [3, 26, 22]]
    assert out["most_apart"] == 4 and out["real_replica_minutes"] == 94
    assert compare_replicas([21], [20])["outside_tolerance"] == 1


def test_replicas_compared_allow_the_real_hpa_its_lag_and_no_more():
    # a step up at minute 2 and down at minute 6: the real HPA two minutes late on each
    predicted = [15, 15, 38, 38, 38, 38, 15, 15, 15, 15]
    real = [15, 15, 15, 15, 38, 38, 38, 38, 15, 15]
    out = compare_replicas(real, predicted, tolerance=0.1, lag=2)
    assert out["minutes_apart"] == 4 and out["lagging"] == 4 and out["outside_tolerance"] == 0
    # a minute later than the lag is outside, as is any minute with no lag allowed
    late = compare_replicas([15, 15, 15, 15, 15, 38, 38, 38, 38, 15], predicted, tolerance=0.1, lag=2)
    assert late["first_outside_tolerance"] == [4, 8] and late["lagging"] == 4
    assert compare_replicas(real, predicted, tolerance=0.1)["outside_tolerance"] == 4
    # a figure the model never asked for is outside whatever the lag
    assert compare_replicas([15, 15, 27, 38], [15, 15, 38, 38], tolerance=0.1, lag=2)["first_outside_tolerance"] == [2]


def test_a_missing_minute_shows_yesterdays_same_minute_or_nothing():
    metrics = DayMetrics("day", LABELS)
    metrics.remember(-24 * 60 + 600, 9.0)  # yesterday 10:00, as remembered
    assert metrics.update(["web-a", "web-b"], 4.0, 540) == 4.0  # today 09:00, measured
    assert metrics.update(["web-a", "web-b", "web-c"], None, 600) == 9.0  # 10:00 missing: yesterday's
    listed = metrics.answer("GET", "/apis/metrics.k8s.io/v1beta1/pods")[1]["items"]
    assert [i["containers"][0]["usage"]["cpu"] for i in listed] == ["3000m"] * 3
    assert metrics.update(["web-a"], None, 601) is None  # nothing known of yesterday 10:01: nothing shown
    assert metrics.answer("GET", "/apis/metrics.k8s.io/v1beta1/pods")[1]["items"] == []
    # what the source showed itself is tomorrow's fallback, and a remembered figure does not replace it
    metrics.remember(540, 1.0)
    assert metrics.update(["web-a"], None, 540 + 24 * 60) == 4.0
    assert (metrics.fallback_minutes, metrics.missing_minutes) == (2, 1)
    without = DayMetrics("day", LABELS, fallback=False)
    without.remember(-24 * 60 + 600, 9.0)
    assert without.update(["web-a"], None, 600) is None and without.missing_minutes == 1


def test_a_gap_is_minutes_of_every_day_and_may_wrap_midnight():
    assert in_day_window((480, 660), 600) and in_day_window((480, 660), 600 + 24 * 60)
    assert not in_day_window((480, 660), 660) and in_day_window((480, 660), 480 - 24 * 60)
    assert in_day_window((1380, 60), 30) and in_day_window((1380, 60), -30) and not in_day_window((1380, 60), 120)

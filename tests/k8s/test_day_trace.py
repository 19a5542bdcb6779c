"""``tidal bench day --trace``: a user's own day (``tidal cluster simulate``'s trace format) through the real
components, as a user runs the command (its own control plane, KWOK, the HPA on the metrics API, the lending
controller, Tidal's scheduler), beside the simulator's replay of the same trace (``pytest -m sched``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.scheduler.fleet import kwok_binary
from kube.localplane import testbin as control_plane_binaries

pytestmark = [pytest.mark.k8s, pytest.mark.sched]

# 6 nodes of 15 cpus (90): online at 18 cores (15 replicas of 2 cpus at the HPA's 60% target, a third of
# the cluster requested: nodes are lent), a step to 45 cores at 00:45 (38 replicas, 76 cpus: faster than a
# lending notice, so lent nodes come back) and down again at 01:30; offline jobs all along, one pinned to
# the third node
TRACE = ["minute,kind,name,cores,duration_min,tier,node", "0,online,web,18,,,", "45,online,web,45,,,",
         "90,online,web,18,,,", "10,offline,pinned,2,30,high,node-2"] + \
    [f"{m},offline,batch-{m},4,40,low," for m in range(0, 100, 8)]


def test_a_users_trace_runs_through_the_real_components_as_the_simulator_replays_it(tmp_path):
    if control_plane_binaries() is None or kwok_binary() is None:
        pytest.skip("no control plane or KWOK: run `make k8s-testbin kwok`")
    trace = tmp_path / "day.csv"
    trace.write_text("\n".join(TRACE) + "\n")
    done = subprocess.run([sys.executable, "-m", "agent.cli", "bench", "day", "--trace", str(trace), "--hours", "2",
                           "--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    print(json.dumps({k: report[k] for k in ("real", "simulator", "replicas", "offline_labelled", "actions")}, indent=1))
    real, replicas = report["real"], report["replicas"]
    assert real["minutes"] == 120
    # the trace's demand, not the synthetic curve, drove the HPA: 15 replicas, then 38 after the step
    by_hour = report["replicas_by_hour"]
    assert by_hour["simulator"][0] == 15 and max(by_hour["real"]) <= 40, by_hour
    assert replicas["real_replica_minutes"] == pytest.approx(replicas["predicted_replica_minutes"], rel=0.05), replicas
    # apart only where the real HPA acts on a step's use after the model does, one to two day minutes
    # (`cluster.day.HPA_LAG_MINUTES`: the day shows a minute's use after reading its replicas, and the HPA
    # looks once a day minute), at each step (00:45 up, 01:30 down), however far the step moves the replicas;
    # nowhere a figure the model did not ask for then or in the lag before. Nine runs here: 2 or 3 minutes
    # apart, all lagging (CI once saw 3 where the count without the lag allowed 2)
    assert replicas["lag_minutes"] == 2 and replicas["outside_tolerance"] == 0, replicas
    assert replicas["minutes_apart"] <= 2 * replicas["lag_minutes"], replicas
    # the lending decisions the simulator predicts (one period late at most on each)
    lent = report["offline_labelled"]
    assert lent["predicted_node_minutes"] > 0 and any(": take back " in a for a in report["actions"]), report["actions"]
    assert abs(lent["real_node_minutes"] - lent["predicted_node_minutes"]) <= report["lending_period_minutes"], lent
    # the offline jobs are the trace's: the pinned one ran on its node, and none was killed outside a notice
    offline = real["offline"]
    assert offline["pinned_jobs"] == 1 and offline["pinned_elsewhere"] == [], offline
    assert offline["completed_by_tier"]["high"] == 1, offline
    assert offline["killed_outside_notice"] == 0, offline["killed_outside_notice_first"]

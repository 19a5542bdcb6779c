"""A day compressed onto a real control plane, beside the simulator's prediction of it (``pytest -m sched``).

Real: kube-apiserver, the deployment and replicaset controllers of kube-controller-manager, kube-scheduler as
shipped, KWOK running the pods on nodes made from one of hwloc's machines, and Tidal's lending controller as
shipped (cordon, the Eviction API, the node-state label) on the day's clock. The online replicas per day
minute are the simulator's own (its HPA rule on its demand curve), so the two runs differ only where the
components do (``cluster.day``; ``tidal bench day`` runs the same).
"""

from __future__ import annotations

import json

import pytest

from agent.bench.fleet import node_shape
from cluster import day
from cluster.scheduler.fleet import Fleet, kwok_binary

pytestmark = [pytest.mark.k8s, pytest.mark.sched]


@pytest.fixture(scope="module")
def day_plane(plane):
    kwok = kwok_binary()
    if kwok is None:
        pytest.skip("no KWOK: run `make kwok`")
    plane.start_controller_manager(extra=("deployment-controller", "replicaset-controller"))
    plane.start_default_scheduler()
    fleet = Fleet(plane, kwok)
    fleet.install_crds()
    fleet.start_kwok()
    yield plane, fleet
    fleet.stop()


def test_a_compressed_day_lends_and_takes_back_as_the_simulator_predicts(day_plane, hwloc_trees):
    plane, fleet = day_plane
    # tidal bench day's defaults: 6 nodes, a day minute in 0.15 s (the day in 216 s), the controller every 30
    # day minutes (its shipped 30 s period would be 2,880 passes in those 216 s). At 0.1 s the driver fell up
    # to 6.6 day minutes behind the clock while Tidal's scheduler placed a backlog of offline pods on a node
    # just lent
    report = day.bench(plane, fleet, node_shape("16amd64-8n2c", hwloc_trees["16amd64-8n2c"]))
    print(json.dumps(report, indent=1))
    real, lent = report["real"], report["offline_labelled_by_hour"]
    assert real["minutes"] == 24 * 60 and real["late_minutes"] < report["lending_period_minutes"] / 3, real
    # the day lends at night and takes everything back for the evening peak, as predicted
    assert lent["simulator"][4] >= 3 and lent["simulator"][20] == 0, lent
    assert lent["real"][4] >= 3 and lent["real"][20] == 0, lent
    assert any(": lend " in a for a in report["actions"]) and any(": take back " in a for a in report["actions"])
    # the stated tolerance: 5% of the node-minutes lent. The runs decide on the same minutes with the same
    # rule; the real one on the pods as the API server has them then, which under load can trail the
    # replicas asked for by a pass: a decision a period late moves 30 node-minutes (1.1% of this day's 2,670).
    # Five runs here, one beside two busy loops: 2,670 against 2,670, no minute apart
    against = report["offline_labelled"]
    assert against["real_node_minutes"] == pytest.approx(against["predicted_node_minutes"], rel=0.05), against
    # replicas no node could hold: whole pods (7 of 2 cpus on a 15-cpu node) as demand climbs toward a
    # take-back; predicted 9 replica-minutes, 4 here. A take-back a period late would add up to one period
    assert real["unschedulable_replica_minutes"] <= report["simulator"]["unplaced_replica_minutes"] \
        + report["lending_period_minutes"], (real, report["simulator"])
    # offline work through the day: the simulator's jobs as pods on Tidal's scheduler, the nodes' agents'
    # rules in a stand-in (cluster.daynodes). No offline pod was killed outside a notice (every kill was its
    # node's agent evicting by tier for online, or at the end of a take-back notice)
    offline, predicted = real["offline"], report["simulator"]
    assert offline["killed_outside_notice"] == 0, offline["killed_outside_notice_first"]
    assert sum(offline["completed_by_tier"].values()) > 300, offline
    # the cluster busier than with separate pools (here online's peak needs every node: offline gets none)
    assert real["avg_util"] > report["separate_pools"]["avg_util"] + 0.2, (real["avg_util"], report["separate_pools"])
    # the stated tolerance against the simulator: utilization within 5 points, offline core-hours within 15%.
    # The real run packs whole jobs per node and evicts per node (the simulator's offline work is a fluid over
    # the cluster's offline capacity, docs/benchmarks): it runs less and evicts more. Five runs here:
    # utilization 76.4-77.5% against 80.5%, offline 91-94% of the predicted core-hours
    assert abs(real["avg_util"] - predicted["avg_util"]) <= 0.05, (real["avg_util"], predicted["avg_util"])
    assert offline["core_hours"] == pytest.approx(predicted["offline_core_hours"], rel=0.15), (offline, predicted)

"""The scheduler's parts without an API server: pods as parsed, the node table, filters, placement, gangs,
preemption and the dispatcher's order. The real tier (tests/k8s/test_scheduler_tier.py) runs them on an API
server with KWOK nodes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from contracts.reports import NodeReport, Zone
from cluster.scheduler.core import Placer, tolerates
from cluster.scheduler.nodes import NodeTable
from cluster.scheduler.pods import PodInfo, pod_requests
from cluster.scheduler.preempt import Budget, choose
from cluster.scheduler.queue import Dispatcher, Gang

GIB = 1 << 30
_uids = itertools.count()


def pod(name="p", cpu="500m", memory="1Gi", priority=0, annotations=None, labels=None, node="", limits=None,
        extra=None, created="2026-11-26T10:00:00Z", scheduler="tidal-scheduler", **spec):
    resources = {"requests": {"cpu": cpu, "memory": memory, **(extra or {})}}
    if limits:
        resources["limits"] = limits
    body = {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{next(_uids)}",
                         "creationTimestamp": created, "annotations": annotations or {}, "labels": labels or {}},
            "spec": {"schedulerName": scheduler, "priority": priority, "nodeName": node,
                     "containers": [{"name": "c", "resources": resources}], **spec},
            "status": {"phase": "Pending"}}
    return PodInfo.parse(body)


def dedicated(name="d", cpus=2, memory="2Gi", numa=True, **kw):
    limits = {"cpu": str(cpus), "memory": memory}
    return pod(name, cpu=str(cpus), memory=memory, limits=limits,
               annotations={"tidal.io/numa-binding": "true"} if numa else {}, **kw)


def reclaimed(name="r", millicpu=1000, tier="low", priority=0, **kw):
    return pod(name, cpu="0", memory="0", extra={"tidal.io/reclaimed-millicpu": str(millicpu)},
               annotations={"tidal.io/tier": tier}, priority=priority, **kw)


def declared_reclaimed(name, cpu="1", tier="low", priority=0):
    """A reclaimed pod by annotation that requests plain cpu (Katalyst's style): it holds node cpu."""
    return pod(name, cpu=cpu, memory="0", priority=priority,
               annotations={"tidal.io/qos-level": "reclaimed_cores", "tidal.io/tier": tier})


def node(name, cpu="8", memory="32Gi", pods="110", labels=None, taints=(), unschedulable=False, extra=None):
    allocatable = {"cpu": cpu, "memory": memory, "pods": pods, **(extra or {})}
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": list(taints), "unschedulable": unschedulable},
            "status": {"allocatable": allocatable}}


def table_of(*nodes, reports=()):
    t = NodeTable(capacity=4)
    for n in nodes:
        t.set_node(n)
    for r in reports:
        t.set_report(r)
    return t


def place(placer, pods):
    vectors = {p.uid: placer.table.vector(p.requests) for p in pods}
    taken, conflicts = placer.commit(placer.propose(pods), vectors)
    assert not conflicts
    return [(p.name, placer.table.names[row], zone) for p, row, zone in taken]


# ---- pods -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,want", [
    ({"containers": [{"resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}},
                     {"resources": {"requests": {"cpu": "1"}}}]}, {"cpu": 1250, "memory": GIB, "pods": 1}),
    ({"containers": [{"resources": {"limits": {"cpu": "2", "memory": "2Gi"}}}]}, {"cpu": 2000, "memory": 2 * GIB, "pods": 1}),
    ({"containers": [{"resources": {"requests": {"cpu": "100m"}}}],
      "initContainers": [{"resources": {"requests": {"cpu": "3"}}}]}, {"cpu": 3000, "pods": 1}),
    ({"containers": [{"resources": {"requests": {"cpu": "1"}}}], "overhead": {"cpu": "250m"}}, {"cpu": 1250, "pods": 1}),
    ({"containers": [{"resources": {"requests": {"tidal.io/reclaimed-millicpu": "1500"}}}]},
     {"tidal.io/reclaimed-millicpu": 1500, "pods": 1}),
], ids=["sum", "limits-as-requests", "init-max", "overhead", "extended"])
def test_a_pods_requests_are_what_the_kubelet_admits(spec, want):
    assert pod_requests(spec) == want


def test_kinds_ranks_and_gangs_are_read_from_the_pod():
    d, s, r = dedicated(), pod(priority=100), reclaimed(tier="min", priority=1000)
    assert (d.kind, d.numa_bound) == ("dedicated", True) and s.kind == "shared" and r.kind == "reclaimed"
    assert r.rank < pod(priority=-5).rank  # any online pod outranks any reclaimed pod
    assert reclaimed(tier="low", priority=10).rank < reclaimed(tier="min").rank < reclaimed(tier="high").rank
    assert pod(labels={"scheduling.x-k8s.io/pod-group": "job"}).group == "job"
    assert pod(labels={"pod-group.scheduling.sigs.k8s.io": "old"}).group == "old"
    assert pod("a").template == pod("b").template != pod("c", cpu="1").template


def test_a_pod_with_an_unreadable_request_is_never_placed():
    bad = pod(cpu="lots")
    t = table_of(node("n1"))
    placer = Placer(t)
    assert bad.problem and placer.propose([bad]) == []
    assert "unreadable resource request" in placer.why_not(bad)


# ---- filters ------------------------------------------------------------------------------------------------------
NOEXEC = {"key": "dedicated", "value": "gpu", "effect": "NoExecute"}


@pytest.mark.parametrize("tolerations,taint,want", [
    ([], ("k", "v", "NoSchedule"), False),
    ([{"key": "k", "value": "v", "effect": "NoSchedule"}], ("k", "v", "NoSchedule"), True),
    ([{"key": "k", "value": "w"}], ("k", "v", "NoSchedule"), False),
    ([{"key": "k", "operator": "Exists"}], ("k", "v", "NoExecute"), True),
    ([{"operator": "Exists"}], ("any", "", "NoSchedule"), True),
    ([{"key": "k", "operator": "Exists", "effect": "NoExecute"}], ("k", "v", "NoSchedule"), False),
], ids=["none", "equal", "other-value", "exists", "tolerate-all", "other-effect"])
def test_tolerations(tolerations, taint, want):
    assert tolerates(tolerations, taint) is want


def test_filters_taints_selectors_affinity_cordons_and_lending_states():
    t = table_of(
        node("plain", labels={"zone": "a", "gen": "3"}),
        node("tainted", labels={"zone": "a", "gen": "5"}, taints=[NOEXEC]),
        node("cordoned", labels={"zone": "b", "gen": "4"}, unschedulable=True),
        node("other-zone", labels={"zone": "b", "gen": "6"}),
    )
    t.set_report(NodeReport("other-zone", [Zone(8000, 32 * GIB)], state="Offline", updated=1e12))
    placer = Placer(t)

    def names(p):
        mask = placer.static_mask(p)
        return sorted(t.names[r] for r in np.flatnonzero(mask[:t.rows]))

    assert names(pod()) == ["plain"]  # tainted, cordoned, lent
    assert names(pod(tolerations=[{"key": "dedicated", "operator": "Exists"}])) == ["plain", "tainted"]
    assert names(pod(nodeSelector={"zone": "b"})) == []
    assert names(reclaimed()) == ["other-zone", "plain"]  # reclaimed work may use a lent node
    terms = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gen", "operator": "Gt", "values": ["3"]}]}]}
    tolerant = [{"key": "dedicated", "operator": "Exists"}]
    assert names(pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": terms}},
                     tolerations=tolerant)) == ["tainted"]  # gen 4 is cordoned, gen 6 lent
    notin = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]},
                                   {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["plain"]}]}]}
    assert names(pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": notin}},
                     tolerations=tolerant)) == ["plain"]
    cordon_ok = tolerant + [{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]
    assert names(pod(tolerations=cordon_ok)) == ["cordoned", "plain", "tainted"]
    assert names(pod(tolerations=[{"operator": "Exists"}])) == ["cordoned", "plain", "tainted"]  # tolerates all


def test_a_label_change_is_seen_by_the_next_placement():
    t = table_of(node("n1", labels={"pool": "a"}))
    placer = Placer(t)
    assert place(placer, [pod(nodeSelector={"pool": "b"})]) == []
    t.set_node(node("n1", labels={"pool": "b"}))
    assert place(placer, [pod("x", nodeSelector={"pool": "b"})]) == [("x", "n1", None)]


# ---- fit and placement --------------------------------------------------------------------------------------------
def test_a_run_of_identical_pods_fills_nodes_without_overcommitting_any_resource():
    t = table_of(node("small", cpu="2", memory="4Gi"), node("big", cpu="8", memory="8Gi", pods="5"))
    placer = Placer(t, "pack")
    pods = [pod(f"p{i}", cpu="1", memory="1Gi") for i in range(10)]
    placed = place(placer, pods)
    assert len(placed) == 7  # small: 2 (cpu), big: 5 (pods)
    assert sum(1 for _, n, _ in placed if n == "small") == 2
    assert np.all(t.used[:t.rows] <= t.alloc[:t.rows])
    assert "Insufficient cpu" in placer.why_not(pod("late", cpu="1"))


@pytest.mark.parametrize("policy,first", [("pack", "tight"), ("spread", "roomy")])
def test_pack_takes_the_tightest_node_and_spread_the_freest(policy, first):
    t = table_of(node("roomy", cpu="16"), node("tight", cpu="4"))
    assert place(Placer(t, policy), [pod(cpu="1")])[0][1] == first


def test_numa_bound_pods_go_only_into_one_zone_of_a_fresh_report():
    t = table_of(node("two-zones", cpu="16", memory="64Gi"), node("no-report", cpu="64", memory="256Gi"),
                 node("stale", cpu="64", memory="256Gi"))
    t.set_report(NodeReport("two-zones", [Zone(3000, 16 * GIB), Zone(5000, 16 * GIB)], updated=1e12))
    t.set_report(NodeReport("stale", [Zone(64000, 256 * GIB)], updated=1.0))
    placer = Placer(t, "pack", stale_after=120)
    placed = place(placer, [dedicated(f"d{i}", cpus=2) for i in range(5)])
    # zone 0 holds one (3 cpus), zone 1 two (5 cpus): three in all, each inside a zone, never on the others
    assert sorted((n, z) for _, n, z in placed) == [("two-zones", 0), ("two-zones", 1), ("two-zones", 1)]
    assert list(t.zone_cpu[t.row("two-zones"), :2]) == [1000, 1000]
    why = placer.why_not(dedicated("late"))
    assert "no topology report newer than 120s" in why and "no single NUMA zone with 2 cpus" in why


def test_a_report_that_lists_a_pod_takes_over_its_zone_reservation():
    t = table_of(node("n", cpu="16", memory="64Gi"))
    t.set_report(NodeReport("n", [Zone(4000, 16 * GIB)], updated=1e12))
    placer = Placer(t)
    d = dedicated("d", cpus=2)
    place(placer, [d])
    assert t.zone_cpu[0, 0] == 2000
    t.set_report(NodeReport("n", [Zone(2000, 14 * GIB)], updated=1e12, attributes={"tidal.io/pods": d.uid}))
    assert t.zone_cpu[0, 0] == 2000  # the agent's figure, not counted twice


def test_commit_refuses_what_another_placement_took_first():
    t = table_of(node("n", cpu="2"))
    a, b = Placer(t), Placer(t)
    p1, p2 = pod("one", cpu="2"), pod("two", cpu="2")
    proposal1, proposal2 = a.propose([p1]), b.propose([p2])  # both saw the node free
    vectors = {p.uid: t.vector(p.requests) for p in (p1, p2)}
    taken, conflicts = a.commit(proposal1, vectors)
    assert len(taken) == 1 and not conflicts
    taken, conflicts = b.commit(proposal2, vectors)
    assert not taken and [p.name for p, _, _ in conflicts] == ["two"]
    assert t.used[0, t.columns["cpu"]] == 2000


def test_shards_try_their_own_nodes_first():
    t = table_of(*(node(f"n{i}") for i in range(4)))
    first = [place(Placer(t, "pack", partition=(s, 2)), [pod(f"s{s}")])[0][1] for s in (0, 1)]
    assert [t.row(n) % 2 for n in first] == [0, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 16), st.integers(1, 64)), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(1, 4), st.integers(1, 8), st.booleans(), st.integers(1, 30)), min_size=1,
                max_size=8))
def test_random_fleets_and_runs_never_overcommit_a_node_or_a_zone(nodes, runs):
    t = NodeTable(capacity=2)
    for i, (cpus, mem) in enumerate(nodes):
        t.set_node(node(f"n{i}", cpu=str(cpus), memory=f"{mem}Gi"))
        half = cpus * 500
        t.set_report(NodeReport(f"n{i}", [Zone(half, mem * GIB // 2), Zone(cpus * 1000 - half, mem * GIB // 2)],
                                updated=1e12))
    placer = Placer(t)
    for j, (cpus, mem, numa, count) in enumerate(runs):
        make = (lambda k: dedicated(f"r{j}-{k}", cpus=cpus, memory=f"{mem}Gi")) if numa else \
            (lambda k: pod(f"r{j}-{k}", cpu=str(cpus), memory=f"{mem}Gi"))
        place(placer, [make(k) for k in range(count)])
        assert np.all(t.used[:t.rows] <= t.alloc[:t.rows])
        assert np.all(t.zone_cpu[:t.rows] >= 0) and np.all(t.zone_mem[:t.rows] >= 0)


# ---- preemption ---------------------------------------------------------------------------------------------------
def _bound(t, placer, pods, where):
    everyone = {}
    vectors = {}
    for p in pods:
        p.node = where
        vectors[p.uid] = t.vector(p.requests)
        t.add_pod(t.row(where), p, vectors[p.uid], None)
        everyone[p.uid] = p
    return everyone, vectors


def test_preemption_takes_reclaimed_pods_by_tier_then_lower_priority_online_pods():
    t = table_of(node("n", cpu="5", memory="16Gi"))  # full: 1 + 1 + 1 + 2 cpus held
    placer = Placer(t)
    victims = [pod("online-low", cpu="1", priority=-10), declared_reclaimed("r-high", tier="high"),
               declared_reclaimed("r-low", tier="low"), pod("online-mid", cpu="2", priority=5)]
    pods, vectors = _bound(t, placer, victims, "n")
    preemptor = pod("urgent", cpu="2", priority=10)
    need = t.vector(preemptor.requests)
    row, chosen = choose(t, preemptor, need, placer.static_mask(preemptor), pods, vectors, [])
    # 2 cpus needed, none free: the two reclaimed pods (low tier first) before any online pod
    assert sorted(v.name for v in chosen) == ["r-high", "r-low"]
    higher = pod("urgent-3", cpu="3", priority=10)
    row, chosen = choose(t, higher, t.vector(higher.requests), placer.static_mask(higher), pods, vectors, [])
    assert sorted(v.name for v in chosen) == ["online-low", "r-high", "r-low"]  # reprieve kept online-mid


def test_preemption_never_takes_a_pod_of_equal_or_higher_rank():
    t = table_of(node("n", cpu="2"))
    placer = Placer(t)
    pods, vectors = _bound(t, placer, [pod("peer", cpu="2", priority=10)], "n")
    preemptor = pod("same", cpu="1", priority=10)
    assert choose(t, preemptor, t.vector(preemptor.requests), placer.static_mask(preemptor), pods, vectors, []) is None
    low = declared_reclaimed("batch", tier="high", priority=10 ** 9)
    assert choose(t, low, t.vector(low.requests), placer.static_mask(low), pods, vectors, []) is None


def test_preemption_respects_a_disruption_budget():
    t = table_of(node("a", cpu="2"), node("b", cpu="2"))
    placer = Placer(t)
    guarded = pod("guarded", cpu="2", labels={"app": "db"})
    free_to_go = pod("spare", cpu="2", priority=-1, labels={"app": "web"})
    pods, vectors = _bound(t, placer, [guarded], "a")
    more, more_vectors = _bound(t, placer, [free_to_go], "b")
    pods.update(more)
    vectors.update(more_vectors)
    pdb = Budget({"metadata": {"namespace": "ns", "name": "db"},
                  "spec": {"selector": {"matchLabels": {"app": "db"}}}, "status": {"disruptionsAllowed": 0}})
    preemptor = pod("urgent", cpu="2", priority=100)
    row, chosen = choose(t, preemptor, t.vector(preemptor.requests), placer.static_mask(preemptor), pods, vectors,
                         [pdb])
    # without the budget, "guarded" (priority 0 on node a) and "spare" (-1 on b) tie but for priority
    assert t.names[row] == "b" and [v.name for v in chosen] == ["spare"]
    pods.pop(free_to_go.uid)
    assert choose(t, preemptor, t.vector(preemptor.requests), placer.static_mask(preemptor), pods, vectors,
                  [pdb]) is None


# ---- the dispatcher -------------------------------------------------------------------------------------------------
def test_units_come_by_priority_then_age_and_identical_pods_come_together():
    d = Dispatcher(batch=10)
    old = [pod(f"old{i}", created="2026-11-26T09:00:00Z") for i in range(3)]
    urgent = pod("urgent", priority=100, created="2026-11-26T11:00:00Z")
    other = pod("other", cpu="2", created="2026-11-26T09:30:00Z")
    for p in old + [other, urgent]:
        d.add(p)
    assert [p.name for p in d.pop(0).pods] == ["urgent"]
    assert [p.name for p in d.pop(0).pods] == ["old0", "old1", "old2"]
    assert [p.name for p in d.pop(0).pods] == ["other"]
    assert d.pop(0) is None


def test_a_gang_waits_for_its_pod_group_and_its_min_member():
    d = Dispatcher()
    members = [pod(f"w{i}", labels={"scheduling.x-k8s.io/pod-group": "job"}) for i in range(3)]
    for p in members[:2]:
        d.add(p)
    assert d.pop(0) is None and "waiting for PodGroup ns/job" in d.parked[("group", "ns", "job")].reason
    d.set_gang(Gang("ns", "job", min_member=3))
    assert d.pop(0) is None and "waiting for 1 more pod(s)" in d.parked[("group", "ns", "job")].reason
    d.add(members[2])
    unit = d.pop(0)
    assert unit.gang is not None and unit.need == 3 and len(unit.pods) == 3


def test_a_parked_unit_comes_back_when_the_cluster_changes_and_its_backoff_passed(monkeypatch):
    import cluster.scheduler.queue as q

    monkeypatch.setattr(q, "BACKOFF_FIRST", 0.0)
    d = Dispatcher()
    p = pod("waiting")
    d.add(p)
    unit = d.pop(0)
    d.park(unit.key, version=5, reason="0/1 nodes are available")
    d.changed(5)
    assert d.pop(0) is None  # nothing changed since it failed
    d.changed(6)
    assert [x.name for x in d.pop(0).pods] == ["waiting"]


def test_fair_share_lets_namespaces_take_turns():
    d = Dispatcher(batch=1, fair=True)
    for i in range(3):
        a = pod(f"a{i}", created=f"2026-11-26T09:00:0{i}Z")
        a.namespace = "team-a"
        d.add(a)
    b = pod("b0", created="2026-11-26T10:00:00Z")
    b.namespace = "team-b"
    d.add(b)
    order = [d.pop(0).pods[0].name for _ in range(4)]
    assert order.index("b0") <= 1  # team-b need not wait behind all of team-a's older pods


def test_the_backoff_is_a_setting_and_a_bad_one_is_refused():
    d = Dispatcher(backoff=(0.25, 0.5))
    d.add(pod("waiting"))
    unit = d.pop(0)
    for attempt, wait in ((1, 0.25), (2, 0.5), (3, 0.5)):
        d.park(unit.key, version=attempt, reason="no room")
        parked = d.parked[unit.key]
        assert parked.retry_after - parked.since == pytest.approx(wait)
    with pytest.raises(ValueError):
        Dispatcher(backoff=(2.0, 1.0))

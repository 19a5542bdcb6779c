"""The placement core: quality invariants (property tests on small clusters) and the fit rules."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.placement.baseline import LoopPlacer
from cluster.placement.model import NodeReport, PlacementError, PodSpec, Zone
from cluster.placement.placer import Placer
from cluster.placement.view import ClusterView
from cluster.placement.workload import GIB, fixture_shapes, make_cluster, make_units


def two_zone_node(name, free_cpus=(4, 4), state="Online", updated=1000.0, reclaimed=0):
    return NodeReport(name, [Zone(c * 1000, 16 * GIB) for c in free_cpus], reclaimed_millicpu=reclaimed,
                      reclaimed_memory=8 * GIB, state=state, updated=updated)


def test_a_numa_bound_pod_never_goes_where_no_single_zone_holds_it():
    # node-a has 6 free cpus in all but only 3 per zone; node-b has 4 in one zone
    view = ClusterView([two_zone_node("a", (3, 3)), two_zone_node("b", (4, 0))])
    placer = Placer(view)
    spec = PodSpec("dedicated", 4000, GIB, numa_bound=True)
    assert placer.filter(spec).tolist() == [False, True]
    placement = placer.place(spec, 2)
    assert placement.nodes == [(1, 0, 1)] and placement.placed == 1  # the second copy fits nowhere
    # the same pod without NUMA binding fits node-a's 6 cpus summed
    assert placer.filter(PodSpec("dedicated", 4000, GIB)).tolist() == [True, False]


def test_pack_takes_the_tightest_node_and_spread_the_freest():
    reports = [two_zone_node("big", (8, 8)), two_zone_node("small", (2, 2))]
    spec = PodSpec("shared", 1000, GIB)
    assert Placer(ClusterView(reports), "pack").place(spec).nodes[0][0] == 1
    assert Placer(ClusterView(reports), "spread").place(spec).nodes[0][0] == 0


def test_states_and_staleness_filter_nodes():
    reports = [two_zone_node("online", reclaimed=4000), two_zone_node("lent", state="Offline", reclaimed=4000),
               two_zone_node("leaving", state="OnlineToOffline", reclaimed=4000),
               two_zone_node("old", updated=10.0, reclaimed=4000)]
    placer = Placer(ClusterView(reports), stale_after=60)
    online = PodSpec("shared", 500, GIB)
    offline = PodSpec("reclaimed", 500, GIB)
    with_now = lambda spec: placer.node_fit(spec, now=1030.0)[0] > 0  # noqa: E731
    assert with_now(online).tolist() == [True, False, False, False]  # stale "old" is unknown, not trusted
    assert with_now(offline).tolist() == [True, True, False, False]  # lent nodes take offline pods


def test_scores_are_in_the_extender_range():
    placer = Placer(ClusterView([two_zone_node("a", (8, 8)), two_zone_node("b", (1, 1)),
                                 two_zone_node("c", (0, 0))]))
    scores = placer.scores(PodSpec("shared", 1000, GIB), np.arange(3))
    assert scores[2] == 0 and 0 <= scores[0] < scores[1] <= 100  # pack: the fuller node scores higher


@pytest.mark.parametrize("spec, message", [
    (dict(kind="gpu", millicpu=1000), "expected one of"),
    (dict(kind="shared", millicpu=0), "cpu must be above zero"),
    (dict(kind="shared", millicpu=1000, numa_bound=True), "dedicated pods only"),
    (dict(kind="dedicated", millicpu=1500), "whole cpus"),
], ids=["kind", "zero-cpu", "numa-bound-shared", "fractional-dedicated"])
def test_bad_pod_specs_are_clear_errors(spec, message):
    with pytest.raises(PlacementError, match=message):
        PodSpec(**spec)


def test_unknown_nodes_and_duplicate_reports_are_errors():
    view = ClusterView([two_zone_node("a")])
    with pytest.raises(PlacementError, match="unknown node 'zz'"):
        view.update(two_zone_node("zz"))
    with pytest.raises(PlacementError, match="reported twice"):
        ClusterView([two_zone_node("a"), two_zone_node("a")])


def test_fixture_shapes_are_the_hwloc_machines():
    shapes = fixture_shapes()
    assert len(shapes) == 11
    assert [c for c, _, _ in max(shapes, key=lambda s: sum(c for c, _, _ in s))] == [32] * 8  # 256ppc


unit = st.tuples(
    st.sampled_from(["numa", "dedicated", "shared", "reclaimed"]),
    st.integers(1, 8), st.integers(0, 8), st.integers(1, 30))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.integers(1, 40), seed=st.integers(0, 10 ** 6), units=st.lists(unit, min_size=1, max_size=25),
       policy=st.sampled_from(["pack", "spread"]), sample=st.sampled_from([None, 10.0, 100.0]))
def test_placement_invariants_hold_for_any_cluster_and_pod_sequence(nodes, seed, units, policy, sample):
    view = ClusterView(make_cluster(nodes, seed=seed, now=1000.0))
    placer = Placer(view, policy, sample_percent=sample, min_sample=3)
    for kind, cpus, gib, count in units:
        spec = PodSpec("dedicated" if kind == "numa" else kind, cpus * 1000 if kind in ("numa", "dedicated")
                       else cpus * 250, gib * GIB, numa_bound=kind == "numa")
        cpu, mem, recl = view.cpu.copy(), view.mem.copy(), view.recl_cpu.copy()
        fit_before, zones_before = placer.node_fit(spec)
        placement = placer.place(spec, count)
        view.check()  # nothing over-committed
        assert placement.placed <= count
        for node, zone, n in placement.nodes:
            assert n > 0 and fit_before[node] >= n
            if spec.numa_bound:
                assert zone is not None and zones_before[node, zone] >= n  # each copy inside one zone
        # what the placement took is exactly what the view lost
        took = sum(n for _, _, n in placement.nodes) * spec.millicpu
        lost = (recl - view.recl_cpu).sum() if kind == "reclaimed" else (cpu - view.cpu).sum()
        assert lost == took
        if kind != "reclaimed":
            assert ((mem - view.mem).sum()) == placement.placed * spec.memory
        # nothing left pending while a node could still take a copy (sampling never hides a fit)
        if placement.placed < count:
            assert not placer.filter(spec).any()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10 ** 6), count=st.integers(1, 60))
def test_pack_never_uses_more_nodes_than_spread(seed, count):
    reports = make_cluster(30, seed=seed, now=1000.0)
    spec = PodSpec("shared", 1000, GIB)
    packed = Placer(ClusterView(reports), "pack", sample_percent=100).place(spec, count)
    spread = Placer(ClusterView(reports), "spread", sample_percent=100).place(spec, count)
    assert packed.placed == spread.placed
    assert len(packed.nodes) <= len(spread.nodes)


def test_the_loop_baseline_places_the_same_number_of_pods():
    reports = make_cluster(200, seed=7, now=1000.0)
    units = make_units(3000, seed=8)
    fast, slow = Placer(ClusterView(reports), sample_percent=100), LoopPlacer(ClusterView(reports), sample=200)
    placed_fast = sum(fast.place(spec, n).placed for spec, n in units)
    placed_slow = sum(slow.place(spec, n) for spec, n in units)
    # the same fit rules over the same capacity: equal totals up to how NUMA-bound pods fragment zones
    assert abs(placed_fast - placed_slow) <= 0.02 * 3000
    assert placed_fast > 0.5 * 3000

"""THE lending rule (cluster.lendrule), which the controller and the simulator both run."""

import pytest

from cluster.lendrule import LEND, TAKE_BACK, OnlineNode, decide


def nodes(*rows):
    return [OnlineNode(name, alloc, pods) for name, alloc, pods in rows]


@pytest.mark.parametrize("requested, online, lent, window, want", [
    # low level: lend the node with the fewest online pods, one a period
    (10, nodes(("a", 64, 3), ("b", 64, 1), ("c", 64, 2)), [], False, [(LEND, "b")]),
    # ties: the lowest name
    (10, nodes(("b", 64, 1), ("a", 64, 1)), [], False, [(LEND, "a")]),
    # lending would push the others over the threshold: nothing
    (100, nodes(("a", 64, 1), ("b", 64, 1)), [], False, []),
    # one online node is never lent
    (1, nodes(("a", 64, 0)), [], False, []),
    # over the threshold: as many lent nodes back as bring the level under it, at once
    (250, nodes(("a", 64, 9), ("b", 64, 9)), [("x", 64), ("y", 64), ("z", 64), ("w", 64)], False,
     [(TAKE_BACK, "x"), (TAKE_BACK, "y"), (TAKE_BACK, "z")]),
    # just over: one back
    (120, nodes(("a", 64, 9), ("b", 64, 9)), [("x", 64), ("y", 64)], False, [(TAKE_BACK, "x")]),
    # an online window takes every lent node back, whatever the level
    (1, nodes(("a", 64, 0), ("b", 64, 0)), [("x", 64), ("y", 64)], True, [(TAKE_BACK, "x"), (TAKE_BACK, "y")]),
    # an online window with nothing lent: nothing, and no lending either
    (1, nodes(("a", 64, 0), ("b", 64, 0)), [], True, []),
    # over the threshold with nothing lent: nothing to do
    (200, nodes(("a", 64, 0), ("b", 64, 0)), [], False, []),
], ids=["fewest-pods", "tie-by-name", "others-would-overflow", "last-node", "step-takes-enough-back",
        "one-back", "window-all-back", "window-nothing-lent", "over-nothing-lent"])
def test_the_rule(requested, online, lent, window, want):
    got = decide(requested, online, lent, threshold=0.9, must_be_online=window)
    assert [(a.kind, a.node) for a in got] == want

"""THE cpu eviction rule: which reclaimed work goes when its capacity shrank below what it asks (pure).

Tier ``low`` first, then ``min``, then ``high``; within a tier the youngest first (the least work lost);
until what is left fits. One definition, used by the agent (``agent.qrm.eviction``, on a node's
workloads) and by the compressed day's stand-in for the agents of KWOK nodes (``cluster.daynodes``, on
offline pods), so the day evicts what the agents would. ``cluster.simulate`` runs the same order on numpy
arrays of a whole cluster at once (its tiers are ``EVICTION_ORDER`` reversed).
"""

from __future__ import annotations

from typing import Callable, List, Sequence, TypeVar

EVICTION_ORDER = ("low", "min", "high")  # the first to go, first
TIERS = tuple(reversed(EVICTION_ORDER))  # the tiers as they are listed (flags, annotations): the last to go first

T = TypeVar("T")


def choose_victims(items: Sequence[T], capacity_millicpu: int, tier: Callable[[T], str],
                   millicpu: Callable[[T], int]) -> List[T]:
    """Of ``items`` (reclaimed work, in admission order: later is younger), those to evict for the rest
    to fit in ``capacity_millicpu``, in the order they go; none where all fit."""
    total = sum(millicpu(i) for i in items)
    if total <= capacity_millicpu:
        return []
    age = {id(i): n for n, i in enumerate(items)}
    victims = []
    for item in sorted(items, key=lambda i: (EVICTION_ORDER.index(tier(i)), -age[id(i)])):
        if total <= capacity_millicpu:
            break
        victims.append(item)
        total -= millicpu(item)
    return victims

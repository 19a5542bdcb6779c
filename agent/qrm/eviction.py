"""Which reclaimed workloads to evict when their capacity shrank (pure).

Over-commit: the reclaimed requests add up to more than the capacity. The
kernel throttles at once (the reclaimed quota is the capacity); if the
over-commit lasts a grace period, whole workloads are evicted: tier ``low``
first, then ``min``, then ``high``; within a tier the youngest first (the
least work lost); until the remaining requests fit.
"""

from __future__ import annotations

from typing import List, Sequence

from agent.qrm.model import EVICTION_ORDER, Allocation, QoS


def choose_victims(allocations: Sequence[Allocation], capacity_millicpu: int) -> List[Allocation]:
    reclaimed = [a for a in allocations if a.qos is QoS.RECLAIMED]
    total = sum(a.millicpu for a in reclaimed)
    if total <= capacity_millicpu:
        return []
    order = {a.name: i for i, a in enumerate(allocations)}  # admission order: later is younger
    candidates = sorted(reclaimed, key=lambda a: (EVICTION_ORDER.index(a.tier), -order[a.name]))
    victims = []
    for alloc in candidates:
        if total <= capacity_millicpu:
            break
        victims.append(alloc)
        total -= alloc.millicpu
    return victims

"""Which reclaimed workloads to evict when their cpu capacity shrank or memory ran short (pure).

Over-commit: the reclaimed requests add up to more than the capacity. The
kernel throttles at once (the reclaimed quota is the capacity); if the
over-commit lasts a grace period, whole workloads are evicted: tier ``low``
first, then ``min``, then ``high``; within a tier the youngest first (the
least work lost); until the remaining requests fit.

Memory: when the node runs short of memory, the reclaimed workloads whose
eviction frees what is needed (``choose_memory_victims``): by tier again, the
largest user first within a tier.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Sequence

from agent.qrm.model import EVICTION_ORDER, Allocation, QoS
from contracts import eviction


def choose_victims(allocations: Sequence[Allocation], capacity_millicpu: int) -> List[Allocation]:
    """The reclaimed workloads of ``allocations`` (admission order) to evict for the rest to fit in
    ``capacity_millicpu``: ``contracts.eviction``'s rule."""
    return eviction.choose_victims([a for a in allocations if a.qos is QoS.RECLAIMED], capacity_millicpu,
                                   tier=lambda a: a.tier.value, millicpu=lambda a: a.millicpu)


def choose_memory_victims(allocations: Sequence[Allocation], usage_bytes: Mapping[str, Optional[int]],
                          need_bytes: int) -> List[Allocation]:
    """Reclaimed workloads whose eviction frees ``need_bytes`` of memory: tier ``low`` first, then
    ``min``, then ``high``; within a tier the largest user first (the fewest evictions free the most);
    until their use adds up to ``need_bytes`` (all of them if it never does). A workload whose use is
    unknown or nothing is never chosen (its eviction frees nothing); nor is online work."""
    if need_bytes <= 0:
        return []
    reclaimed = [a for a in allocations if a.qos is QoS.RECLAIMED and (usage_bytes.get(a.name) or 0) > 0]
    used = {a.name: usage_bytes[a.name] or 0 for a in reclaimed}
    candidates = sorted(reclaimed, key=lambda a: (EVICTION_ORDER.index(a.tier), -used[a.name]))
    victims: List[Allocation] = []
    freed = 0
    for alloc in candidates:
        if freed >= need_bytes:
            break
        victims.append(alloc)
        freed += used[alloc.name]
    return victims

"""Eviction: reclaimed work that no longer fits, and whatever a lending notice's end leaves.

Over-committed reclaimed work (its requests above the capacity) is first
throttled by the reclaimed parent's quota; if it stays over for
``eviction_grace`` seconds, whole workloads are killed by tier (low, then
min, then high; ``qrm.eviction.choose_victims``). Each eviction is recorded
(``/v1/evictions``, metrics) with its reason.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable, Dict, List, Optional

from agent.qrm.eviction import choose_victims
from agent.qrm.model import Allocation, QoS
from agent.services.enforcement import Enforcement
from agent.services.owner import StateOwner

log = logging.getLogger("tidal.agent")


class Eviction:
    def __init__(self, owner: StateOwner, enforcement: Enforcement, grace: float,
                 forget: Callable[[str], None]) -> None:
        """``forget(name)``: drop what admission keeps of a workload once it is gone."""
        self.owner = owner
        self.enforcement = enforcement
        self.grace = grace
        self.forget = forget
        self.kill_signal = signal.SIGKILL
        self.evictions: List[Dict[str, Any]] = []
        self.by_tier: Dict[str, int] = {"low": 0, "min": 0, "high": 0}
        self.overcommit_since: Optional[float] = None

    def evict(self, alloc: Allocation, reason: str, epoch: Optional[float] = None) -> None:
        owner = self.owner
        pids = [pid for path in self.enforcement.cgroups_of(alloc)
                for pid in self.enforcement.driver.kill(path, self.kill_signal)]
        record = {"name": alloc.name, "qos": alloc.qos.value, "tier": alloc.tier.value if alloc.qos is QoS.RECLAIMED
                  else None, "millicpu": alloc.millicpu, "reason": reason, "pids": pids,
                  "at": time.time() if epoch is None else epoch}
        self.evictions.append(record)
        del self.evictions[:-200]
        if alloc.qos is QoS.RECLAIMED:
            self.by_tier[alloc.tier.value] += 1
        log.warning("evicted %s (%s, %d pids): %s", alloc.name, record["tier"] or alloc.qos.value, len(pids), reason)
        owner.commit(owner.state.without(alloc.name))
        owner.placements.pop(alloc.name, None)
        self.forget(alloc.name)

    def overcommit(self, now: float) -> None:
        # what the kernel lets reclaimed work use (the unrounded estimate), not the whole cores offline
        # systems are told: work that fits the quota is throttled, not over-committed
        capacity = self.enforcement.limits()[0]
        if capacity is None:
            capacity = self.owner.state.reclaim_millicpu
        if capacity is None:
            return
        victims = choose_victims(self.owner.state.allocations, capacity)
        if not victims:
            self.overcommit_since = None
            return
        if self.overcommit_since is None:
            self.overcommit_since = now  # throttled by the quota from now on
            log.info("reclaimed work over-committed (%d millicpu of capacity); throttled", capacity)
        if now - self.overcommit_since < self.grace:
            return
        for alloc in victims:
            self.evict(alloc, f"reclaimed capacity fell to {capacity} millicpu and stayed there {self.grace:g}s")
        self.overcommit_since = None

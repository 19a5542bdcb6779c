"""Eviction: reclaimed work that no longer fits, and whatever a lending notice's end leaves.

Each eviction has a cause:

* ``cpu``: over-committed reclaimed work (its requests above the capacity) is
  first throttled by the reclaimed parent's quota; if it stays over for
  ``eviction_grace`` seconds, whole workloads are killed by tier (low, then
  min, then high; ``qrm.eviction.choose_victims``). Where no cpu is left for
  reclaimed work at all (every cpu reserved or dedicated: the reserved pool is
  never lent, ``qrm.assignment``), it is evicted at once (``homeless``),
  before the kernel is told anything.
* ``memory``: the node's available memory fell below the watermark
  (``memory_evict_below``, default ``default_watermark``): at once, by tier,
  the largest user first, until what they use brings it back to twice the
  watermark (``qrm.eviction.choose_memory_victims``). The watermark sits
  above the kubelet's own hard eviction threshold (``memory.available<100Mi``
  by default), so offline work goes before the kubelet picks pods by its own
  ranking, and before the kernel's OOM killer picks anyone.
* ``pressure``: online's memory stall share (PSI, ``reporter.pressure``)
  stayed at or above ``memory_pressure_threshold`` percent for
  ``eviction_grace`` seconds: one reclaimed workload (the same order), then
  another each further grace period while it stays there.
* ``lending``: a lending notice ended with work that must go.

Each eviction is recorded (``/v1/evictions``, metrics) with its cause and reason.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable, Dict, List, Optional

from agent.qrm.eviction import choose_memory_victims, choose_victims
from agent.qrm.model import Allocation, QoS
from agent.services.enforcement import Enforcement
from agent.services.owner import StateOwner

log = logging.getLogger("tidal.agent")
MIB = 1 << 20
CAUSES = ("cpu", "memory", "pressure", "lending")


def default_watermark(total_bytes: int) -> int:
    """Available memory below which reclaimed work is evicted: 2% of the node's memory, at least 256 MiB
    (above the kubelet's 100 MiB hard threshold with room for a burst) and at most 2 GiB."""
    return min(2048 * MIB, max(256 * MIB, total_bytes * 2 // 100))


class Eviction:
    def __init__(self, owner: StateOwner, enforcement: Enforcement, grace: float,
                 forget: Callable[[str], None], memory_evict_below: Optional[int] = None,
                 memory_pressure_threshold: float = 0.0) -> None:
        """``forget(name)``: drop what admission keeps of a workload once it is gone.
        ``memory_evict_below``: the watermark in bytes (``None``: ``default_watermark`` of the node's
        memory); ``memory_pressure_threshold``: percent of online's memory stall share (0: off)."""
        self.owner = owner
        self.enforcement = enforcement
        self.grace = grace
        self.forget = forget
        self.memory_evict_below = memory_evict_below
        self.memory_pressure_threshold = memory_pressure_threshold
        self.kill_signal = signal.SIGKILL
        self.evictions: List[Dict[str, Any]] = []
        self.by_tier: Dict[str, int] = {"low": 0, "min": 0, "high": 0}
        self.by_cause: Dict[str, int] = {cause: 0 for cause in CAUSES}
        self.overcommit_since: Optional[float] = None
        self.pressure_since: Optional[float] = None

    def watermark(self, total_bytes: int) -> int:
        return self.memory_evict_below if self.memory_evict_below is not None else default_watermark(total_bytes)

    def evict(self, alloc: Allocation, reason: str, epoch: Optional[float] = None, *, cause: str,
              memory_bytes: Optional[int] = None, capacity_millicpu: Optional[int] = None) -> None:
        """``memory_bytes``: what the workload held (memory causes); ``capacity_millicpu``: the reclaimed
        capacity the decision was made against (cpu cause)."""
        owner = self.owner
        pids = [pid for path in self.enforcement.cgroups_of(alloc)
                for pid in self.enforcement.membership.kill(path, self.kill_signal)]
        record = {"name": alloc.name, "qos": alloc.qos.value, "tier": alloc.tier.value if alloc.qos is QoS.RECLAIMED
                  else None, "millicpu": alloc.millicpu, "memory_bytes": memory_bytes,
                  "capacity_millicpu": capacity_millicpu, "cause": cause,
                  "reason": reason, "pids": pids, "at": time.time() if epoch is None else epoch}
        self.evictions.append(record)
        del self.evictions[:-200]
        if alloc.qos is QoS.RECLAIMED:
            self.by_tier[alloc.tier.value] += 1
        self.by_cause[cause] = self.by_cause.get(cause, 0) + 1
        log.warning("evicted %s (%s, %d pids, cause %s): %s", alloc.name, record["tier"] or alloc.qos.value,
                    len(pids), cause, reason)
        owner.commit(owner.state.without(alloc.name))
        owner.placements.pop(alloc.name, None)
        self.forget(alloc.name)

    def homeless(self, harvest: bool) -> List[str]:
        """Evict every reclaimed workload when no cpu is left for reclaimed work; their names."""
        from agent.qrm.assignment import reclaimed_cpus

        owner = self.owner
        victims = [a for a in owner.state.allocations if a.qos is QoS.RECLAIMED]
        if not victims or reclaimed_cpus(owner.pools(), harvest):
            return []
        for alloc in victims:
            self.evict(alloc, "no cpu is left for reclaimed work (every cpu is reserved, dedicated or an SMT sibling "
                              "of a dedicated cpu; the reserved pool is never lent)", cause="cpu", capacity_millicpu=0)
        return [a.name for a in victims]

    def overcommit(self, now: float) -> None:
        self.homeless(self.enforcement.harvest)
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
            self.evict(alloc, f"reclaimed capacity fell to {capacity} millicpu and stayed there {self.grace:g}s",
                       cause="cpu", capacity_millicpu=capacity)
        self.overcommit_since = None

    def memory_use(self) -> Dict[str, Optional[int]]:
        """Each reclaimed workload's memory use in bytes (its first cgroup's; ``None``: unknown)."""
        driver = self.enforcement.driver
        use: Dict[str, Optional[int]] = {}
        for alloc in self.owner.state.allocations:
            if alloc.qos is QoS.RECLAIMED:
                paths = self.enforcement.cgroups_of(alloc)
                use[alloc.name] = driver.memory_usage_bytes(paths[0]) if paths else None
        return use

    def memory(self, now: float, available_bytes: Optional[int], total_bytes: int,
               pressure_percent: Optional[float]) -> None:
        """The memory causes: the node's available memory under the watermark (at once), online's
        memory pressure at or over its threshold for the grace period (one workload per grace)."""
        if not any(a.qos is QoS.RECLAIMED for a in self.owner.state.allocations):
            self.pressure_since = None
            return
        watermark = self.watermark(total_bytes)
        if available_bytes is not None and available_bytes < watermark:
            use = self.memory_use()
            need = 2 * watermark - available_bytes  # back to twice the watermark: no eviction per period
            for alloc in choose_memory_victims(self.owner.state.allocations, use, need):
                self.evict(alloc, f"the node's available memory fell to {available_bytes // MIB} MiB, under "
                                  f"the {watermark // MIB} MiB watermark", cause="memory",
                           memory_bytes=use.get(alloc.name))
            return
        threshold = self.memory_pressure_threshold
        if threshold <= 0 or pressure_percent is None or pressure_percent < threshold:
            self.pressure_since = None
            return
        if self.pressure_since is None:
            self.pressure_since = now
            log.info("online memory pressure %.1f%% (threshold %g%%): reclaimed work is evicted if it stays "
                     "%gs", pressure_percent, threshold, self.grace)
        if now - self.pressure_since < self.grace:
            return
        use = self.memory_use()
        for alloc in choose_memory_victims(self.owner.state.allocations, use, 1)[:1]:
            self.evict(alloc, f"online memory pressure {pressure_percent:.1f}% stayed at or over {threshold:g}% "
                              f"for {self.grace:g}s", cause="pressure", memory_bytes=use.get(alloc.name))
        self.pressure_since = now  # the next one after another grace period, if it stays

"""Reclaimed capacity ("elastic resources") for offline agents.

capacity = allocatable - reserved - dedicated (unless lent) - estimated online demand

* Online demand is the peak of online usage over the last ``window_s``
  seconds times (1 + ``buffer``). When usage samples are missing or older
  than ``stale_s`` (the sampler died, cgroup files vanished), it falls back to
  the peak recorded for the same hour of the previous day (``HourlyHistory``,
  kept on disk), then to the online requests.
* Smoothing: the capacity shrinks at once, grows at most ``ramp_millicpu_per_s``
  (and ``ramp_bytes_per_s``), and ignores rises under the dead-band.
* Offline agents get whole cores and 512 MiB steps (floored), so a
  ResourceManager never sees 11.73 vcores; the kernel's quota cap is the
  unrounded estimate (``limit_millicpu``), so the fraction is not wasted
  by work already running.

Pure except for ``HourlyHistory``'s file; the caller passes the clock.
"""

from __future__ import annotations

import math
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Optional, Tuple

from contracts.headroom import DEFAULT_BUFFER, online_estimate

MIB = 1024 * 1024
MEMORY_STEP = 512 * MIB


_HOUR = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}$")


def parse_history(data: Any) -> Dict[str, Tuple[int, int]]:
    """``history.json`` (decoded): ``{"hours": {"YYYY-MM-DDTHH": [peak millicpu, peak bytes]}}``, validated."""
    hours = data.get("hours") if isinstance(data, dict) else None
    if not isinstance(hours, dict):
        raise ValueError('expected {"hours": {"YYYY-MM-DDTHH": [millicpu, bytes], ...}}')
    out: Dict[str, Tuple[int, int]] = {}
    for key, value in hours.items():
        if not _HOUR.match(key):
            raise ValueError(f"hour {key!r} is not YYYY-MM-DDTHH")
        if not (isinstance(value, list) and len(value) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in value)):
            raise ValueError(f"hour {key}: expected [millicpu, bytes] as whole numbers >= 0, got {value!r}")
        out[key] = (value[0], value[1])
    return out


@dataclass
class HourlyHistory:
    """Peak online usage per wall-clock hour (``YYYY-MM-DDTHH`` in UTC), 48 hours kept."""

    path: Optional[str] = None
    hours: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # hour -> (peak millicpu, peak bytes)

    @staticmethod
    def key(epoch: float) -> str:
        return time.strftime("%Y-%m-%dT%H", time.gmtime(epoch))

    def record(self, epoch: float, millicpu: int, memory_bytes: int) -> None:
        k = self.key(epoch)
        old = self.hours.get(k, (0, 0))
        self.hours[k] = (max(old[0], millicpu), max(old[1], memory_bytes))
        if len(self.hours) > 48:
            for stale in sorted(self.hours)[:-48]:
                del self.hours[stale]

    def yesterday(self, epoch: float) -> Optional[Tuple[int, int]]:
        return self.hours.get(self.key(epoch - 86400))

    def load(self) -> Optional[str]:
        """Read the history; a warning line when the file is unusable (kept as .bad-N, history empty:
        the estimate falls back to requests until usage is measured)."""
        if not self.path:
            return None
        from agent.statefiles import load_json

        hours, warning = load_json(self.path, parse_history, "usage history starts empty")
        self.hours = hours or {}
        return warning

    def save(self) -> None:
        if not self.path:
            return
        from agent.statefiles import write_json

        write_json(self.path, {"hours": {k: list(v) for k, v in sorted(self.hours.items())}})


@dataclass(frozen=True)
class Capacity:
    millicpu: int
    memory_bytes: int
    source: str  # "usage", "yesterday", "requests"
    numa: Tuple[Tuple[int, int, int], ...] = ()  # (node, millicpu, memory_bytes)
    limit_millicpu: Optional[int] = None  # the unrounded estimate: the kernel's quota cap
    limit_memory_bytes: Optional[int] = None  # the unrounded estimate
    # the kernel's memory limit: the unrounded estimate plus the buffer on online's measured peak (see
    # CapacityEstimator.estimate); None: limit_memory_bytes
    kernel_memory_bytes: Optional[int] = None

    @property
    def cap_millicpu(self) -> int:
        return self.millicpu if self.limit_millicpu is None else max(self.millicpu, self.limit_millicpu)


@dataclass
class CapacityEstimator:
    window_s: float = 300.0
    buffer: float = DEFAULT_BUFFER
    stale_s: float = 10.0
    ramp_millicpu_per_s: float = 500.0
    ramp_bytes_per_s: float = 256 * MIB
    deadband_millicpu: int = 500
    deadband_bytes: int = 256 * MIB
    history: HourlyHistory = field(default_factory=HourlyHistory)
    _samples: Deque[Tuple[float, int, int]] = field(default_factory=deque)
    _node_samples: Deque[Tuple[float, Dict[int, int]]] = field(default_factory=deque)
    _current: Optional[Tuple[int, int]] = None
    _memory_peak: Optional[int] = None  # online's measured memory peak in the window, unbuffered
    _last_update: Optional[float] = None

    def observe(self, now: float, epoch: float, online_millicpu: int, online_bytes: int,
                per_node: Optional[Dict[int, int]] = None) -> None:
        """One usage sample; ``per_node``: online millicpu on each NUMA node's cpus, where known."""
        self._samples.append((now, max(0, online_millicpu), max(0, online_bytes)))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        if per_node is not None:
            self._node_samples.append((now, dict(per_node)))
        while self._node_samples and self._node_samples[0][0] < now - self.window_s:
            self._node_samples.popleft()
        self.history.record(epoch, online_millicpu, online_bytes)

    def node_demand(self, now: float) -> Optional[Dict[int, int]]:
        """Per NUMA node: peak online millicpu in the window x (1 + buffer); ``None`` if unknown or stale."""
        fresh = [s for s in self._node_samples if s[0] >= now - self.window_s]
        if not fresh or fresh[-1][0] < now - self.stale_s:
            return None
        nodes = set().union(*(s[1] for s in fresh))
        return {n: math.ceil(online_estimate(max(s[1].get(n, 0) for s in fresh), self.buffer)) for n in nodes}

    def demand(self, now: float, epoch: float, requests: Tuple[int, int]) -> Tuple[int, int, str]:
        """(millicpu, bytes, source) of online demand, with the buffer."""
        fresh = [s for s in self._samples if s[0] >= now - self.window_s]
        self._memory_peak = None
        if fresh and fresh[-1][0] >= now - self.stale_s:
            cpu, mem = max(s[1] for s in fresh), max(s[2] for s in fresh)
            source = "usage"
            self._memory_peak = mem
        else:
            past = self.history.yesterday(epoch)
            if past is not None:
                cpu, mem = past
                source = "yesterday"
            else:
                return requests[0], requests[1], "requests"
        return math.ceil(online_estimate(cpu, self.buffer)), math.ceil(online_estimate(mem, self.buffer)), source

    def estimate(self, now: float, epoch: float, allocatable: Tuple[int, int], requests: Tuple[int, int],
                 numa: Tuple[Tuple[int, int, int], ...] = ()) -> Capacity:
        """``allocatable``: (millicpu, bytes) offline could have if online used nothing
        (already net of reserved and unlent dedicated). ``numa``: per node the same."""
        cpu_demand, mem_demand, source = self.demand(now, epoch, requests)
        raw_cpu = max(0, allocatable[0] - cpu_demand)
        raw_mem = max(0, allocatable[1] - mem_demand)
        if self._current is None:
            cur_cpu, cur_mem = raw_cpu, raw_mem
        else:
            elapsed = max(0.0, now - (self._last_update or now))
            cur_cpu = self._smooth(self._current[0], raw_cpu, self.deadband_millicpu, self.ramp_millicpu_per_s * elapsed)
            cur_mem = self._smooth(self._current[1], raw_mem, self.deadband_bytes, self.ramp_bytes_per_s * elapsed)
        self._current, self._last_update = (cur_cpu, cur_mem), now
        cpu = cur_cpu // 1000 * 1000
        mem = cur_mem // MEMORY_STEP * MEMORY_STEP
        # Offline schedulers place work that holds memory against the capacity, buffer and all. The
        # kernel's limit leaves the buffer out, where online's peak is measured: what offline may hold
        # beyond its placements there is its own page cache (and tasks outgrowing their requests), which
        # the kernel reclaims first when online grows (memory.low on v2, the soft limit of 0 on v1), and
        # the next period's estimate cuts at once. A limit at the capacity kept that room empty (bench
        # memory-isolation: 0.77 of what online leaves harvested where the job fit)
        buffer_bytes = max(0, mem_demand - self._memory_peak) if self._memory_peak is not None else 0
        return Capacity(cpu, mem, source, self._per_node(now, numa, cpu, mem), limit_millicpu=cur_cpu,
                        limit_memory_bytes=cur_mem, kernel_memory_bytes=min(allocatable[1], cur_mem + buffer_bytes))

    def _per_node(self, now: float, numa, cpu: int, mem: int) -> Tuple[Tuple[int, int, int], ...]:
        """Each node's share: its allocatable less its own online peak x (1 + buffer) where
        per-node usage is measured, else the node capacity split by allocatable; floored,
        and never more in sum than the node-wide figure (taken from the largest first)."""
        if not numa:
            return ()
        total_alloc = sum(n[1] for n in numa) or 1
        demand = self.node_demand(now)
        rows = []
        for node, node_cpu, node_mem in numa:
            share = node_cpu / total_alloc
            if demand is not None:
                node_cap = max(0, node_cpu - demand.get(node, 0))
            else:
                node_cap = min(node_cpu, int(cpu * share))
            rows.append([node, node_cap // 1000 * 1000, min(node_mem, int(mem * share)) // MEMORY_STEP * MEMORY_STEP])
        excess = sum(r[1] for r in rows) - cpu
        for row in sorted(rows, key=lambda r: -r[1]):
            if excess <= 0:
                break
            cut = min(row[1], -(-excess // 1000) * 1000)
            row[1] -= cut
            excess -= cut
        return tuple((n, c, m) for n, c, m in rows)

    @staticmethod
    def _smooth(current: int, raw: int, deadband: int, ramp: float) -> int:
        if raw <= current:
            return raw  # shrink at once
        if raw - current < deadband:
            return current
        return int(min(raw, current + ramp))

"""Usage sampling: per-cpu busy time (psutil) and per-cgroup cpu time (cpuacct / cpu.stat).

Rates are computed between two consecutive samples, in millicpu (1000 = one
cpu fully busy), with the monotonic clock the caller passes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import psutil


def _busy_seconds(times) -> float:
    # steal is time the hypervisor gave to someone else: not demand of this node's work
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))


@dataclass
class UsageSample:
    per_cpu_millicpu: Dict[int, int] = field(default_factory=dict)
    per_cgroup_millicpu: Dict[str, int] = field(default_factory=dict)
    total_millicpu: int = 0


class UsageSampler:
    """Rates between samples at least ``min_interval`` apart: per-cpu times tick
    in jiffies (10 ms), so a shorter interval reads 0% or 100% at random, and
    one such spike would pass for an online peak."""

    def __init__(self, cpu_usage_ns, min_interval: float = 0.1, cpu_ids=None) -> None:
        """``cpu_usage_ns(path) -> int | None`` reads a cgroup's cumulative cpu time.
        ``cpu_ids``: the online cpus, in order: /proc/stat (psutil) lists only online
        cpus, so its n-th entry is the n-th online cpu, not cpu n."""
        self._cgroup_usage = cpu_usage_ns
        self.min_interval = min_interval
        self.cpu_ids = list(cpu_ids) if cpu_ids is not None else None
        self._last_time: Optional[float] = None
        self._last_cpu: Optional[List[float]] = None
        self._last_cgroup: Dict[str, tuple] = {}  # path -> (time, cumulative ns)

    def sample(self, now: float, cgroups: Iterable[str]) -> Optional[UsageSample]:
        """A sample of rates since the previous call (``None`` on the first call,
        and when called again within ``min_interval``)."""
        if self._last_time is not None and now - self._last_time < self.min_interval:
            return None
        cpu_busy = [_busy_seconds(t) for t in psutil.cpu_times(percpu=True)]
        per_cg: Dict[str, int] = {}
        for path in cgroups:  # each path's rate is over the time since that path was last read
            value = self._cgroup_usage(path)
            if value is None:
                continue
            last = self._last_cgroup.get(path)
            if last is not None and now - last[0] >= self.min_interval:
                per_cg[path] = max(0, round((value - last[1]) / 1e9 / (now - last[0]) * 1000))
            self._last_cgroup[path] = (now, value)
        result = None
        if self._last_time is not None and now > self._last_time:
            elapsed = now - self._last_time
            ids = self.cpu_ids if self.cpu_ids is not None and len(self.cpu_ids) == len(cpu_busy) \
                else list(range(len(cpu_busy)))
            per_cpu = {ids[i]: max(0, min(1000, round((b - a) / elapsed * 1000)))
                       for i, (a, b) in enumerate(zip(self._last_cpu or [], cpu_busy))}
            result = UsageSample(per_cpu, per_cg, sum(per_cpu.values()))
        self._last_time, self._last_cpu = now, cpu_busy
        return result

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the counters of cgroups that are gone."""
        keep = set(keep)
        for path in [p for p in self._last_cgroup if p not in keep]:
            del self._last_cgroup[path]

"""Each pod's and container's use, for the NodeUsage report (``contracts.nodeusage``).

cpu: the cgroup's cpu counter (v1 ``cpuacct.usage``, v2 ``cpu.stat`` ``usage_usec``) read at each report,
as a rate over the time since the previous read: a container seen for the first time has no figure yet
and is left out of that report (shown as 0 it would tell an autoscaler the pod idles). memory: the
working set now (in use less the inactive page cache, as the kubelet counts it). The node's own figures
come from ``/proc/stat`` (busy time of every cpu) and ``/proc/meminfo`` (MemTotal - MemAvailable).

A counter that went backwards (a container restarted in a new cgroup of the same name) starts over.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from contracts.nodeusage import ContainerUsage, PodUsage

# (namespace, name, uid, [(container name, its cgroup)]) of one pod
PodPaths = Tuple[str, str, str, Sequence[Tuple[str, str]]]


def node_counters(proc: str = "/proc") -> Tuple[Optional[int], Optional[int]]:
    """(busy ns of all cpus, memory in use bytes) now; ``None`` for a figure that could not be read."""
    busy = used = None
    try:
        with open(f"{proc}/stat") as handle:
            fields = handle.readline().split()
        if fields and fields[0] == "cpu":
            ticks = [int(v) for v in fields[1:8]]  # user nice system idle iowait irq softirq (guest is in user)
            busy = (sum(ticks[0:3]) + sum(ticks[5:7])) * (1_000_000_000 // os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        busy = None
    try:
        info = {}
        with open(f"{proc}/meminfo") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        used = info["MemTotal"] - info["MemAvailable"]
    except (OSError, ValueError, KeyError, IndexError):
        used = None
    return busy, used


class PodUsageMeter:
    """``measure(pods)`` at each report: the pods' figures, and the node's (``node_millicpu``,
    ``node_bytes``)."""

    def __init__(self, driver, node: Callable[[], Tuple[Optional[int], Optional[int]]] = node_counters,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.driver = driver
        self.node = node
        self.clock = clock
        self._last: Dict[str, Tuple[float, int]] = {}  # cgroup (or "" for the node) -> (time, cpu ns)
        self.window_s: Optional[float] = None  # of the last measure: now less the previous one
        self._measured_at: Optional[float] = None
        self.node_millicpu = 0
        self.node_bytes = 0

    def _rate(self, key: str, ns: Optional[int], now: float) -> Optional[int]:
        if ns is None:
            self._last.pop(key, None)
            return None
        before = self._last.get(key)
        self._last[key] = (now, ns)
        if before is None or now <= before[0] or ns < before[1]:
            return None
        return int(round((ns - before[1]) / 1e6 / (now - before[0])))

    def measure(self, pods: Iterable[PodPaths]) -> List[PodUsage]:
        now = self.clock()
        self.window_s = None if self._measured_at is None else now - self._measured_at
        self._measured_at = now
        busy, used = self.node()
        self.node_millicpu = self._rate("", busy, now) or 0
        self.node_bytes = used or 0
        seen = {""}
        out: List[PodUsage] = []
        for namespace, name, uid, containers in pods:
            figures = []
            for container, path in containers:
                seen.add(path)
                cpu = self._rate(path, self.driver.cpu_usage_ns(path), now)
                memory = self.driver.memory_working_set_bytes(path)
                if cpu is not None and memory is not None:
                    figures.append(ContainerUsage(container, cpu, memory))
            if figures:
                out.append(PodUsage(namespace, name, uid, tuple(figures)))
        self._last = {k: v for k, v in self._last.items() if k in seen}
        return out

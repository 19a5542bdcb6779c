"""Online's io pressure, acted on: offline work's block io limited in the kernel.

``services.io_throttle`` decides (pure); this service measures what offline
work moved per device (``isolation.cgroups.blockio``), feeds the loop, and
hands its limits to the desired tree (``knob()``: the ``io_max`` knob of the
reclaimed tree and of each reclaimed pod's cgroup), which the Reconciler
writes like every other knob. The fast guard calls ``on_window`` every
``io_throttle.WINDOW_S``, the period ``on_period``; when either returns True
the caller reconciles.

The limits are not in the state file: Tidal starts unthrottled, so the first
reconcile lifts limits an earlier agent left on the offline cgroups, and on
shutdown (``lift_all``, then a reconcile) this agent's go with it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

from agent.isolation.cgroups.blockio import read_io_bytes
from agent.services.io_throttle import IoThrottle, Limits, Rates

log = logging.getLogger("tidal.agent")
MIB = 1 << 20


class IoGuard:
    def __init__(self, driver, offline_cgroups: Callable[[], List[str]], threshold_percent: float,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.driver = driver
        self.offline_cgroups = offline_cgroups
        self.throttle = IoThrottle(threshold_percent if driver.features.get("io") else 0.0)
        self.stopping = stopping
        self.rates: Dict[str, Tuple[float, float]] = {}  # offline's bytes/s per device, the last window
        self._last: Tuple[Optional[float], Dict[str, Tuple[int, int]]] = (None, {})
        self._lock = threading.Lock()
        self.windows = 0  # fast-guard windows sampled
        # the last windows: (number, online's stall share, whether offline moved data); the last cut's window
        # and time (monotonic)
        self.recent: Deque[Tuple[int, Optional[float], bool]] = deque(maxlen=64)
        self.cut_window: Optional[int] = None
        self.cut_at: Optional[float] = None

    @property
    def active(self) -> bool:
        return self.throttle.threshold > 0

    def _moved(self) -> Dict[str, Tuple[int, int]]:
        total: Dict[str, Tuple[int, int]] = {}
        for path in self.offline_cgroups():
            for device, (read_, write) in (read_io_bytes(self.driver, path) or {}).items():
                before = total.get(device, (0, 0))
                total[device] = (before[0] + read_, before[1] + write)
        return total

    def measure(self, now: float) -> Optional[Rates]:
        """Offline's bytes/s per device since the last call (``None`` on the first); a counter that went
        back (a pod that ended) counts as nothing moved."""
        moved = self._moved()
        last_time, last = self._last
        self._last = (now, moved)
        if last_time is None or now <= last_time:
            return None
        span = now - last_time
        rates = {}
        for device, (read_, write) in moved.items():
            r0, w0 = last.get(device, (read_, write))
            rates[device] = (max(0, read_ - r0) / span, max(0, write - w0) / span)
        self.rates = {d: r for d, r in rates.items() if r != (0, 0)}
        return self.rates

    def on_window(self, percent: Optional[float], now: float) -> bool:
        """A fast-guard window: online's io stall share over it; True when offline was cut."""
        with self._lock:
            self.windows += 1
            rates = self.measure(now)
            self.recent.append((self.windows, percent, bool(rates)))
            if self.stopping() or not self.throttle.on_pressure(percent, rates):
                return False
            self.cut_window, self.cut_at = self.windows, now
            log.info("online io pressure %.1f%% (threshold %g%%): offline io limited to %s", percent,
                     self.throttle.threshold, describe(self.throttle.limits))
            return True

    def on_period(self, percent: Optional[float]) -> bool:
        """A period: the limits grow back once online has been quiet; True when they changed."""
        with self._lock:
            if self.stopping() or not self.throttle.on_period(percent):
                return False
            log.info("online io pressure is down: offline io %s", describe(self.throttle.limits) or "no longer limited")
            return True

    def knob(self) -> Tuple[Tuple[str, Optional[int], Optional[int]], ...]:
        """The limits as the desired tree's ``io_max`` knob: ``((device, read_bps, write_bps), ...)``."""
        with self._lock:
            return tuple((d, r, w) for d, (r, w) in sorted(self.throttle.limits.items()))

    def lift_all(self) -> bool:
        """On shutdown: this agent's limits go with it (True when there were some: reconcile then)."""
        with self._lock:
            had = bool(self.throttle.limits)
            self.throttle.limits = {}
            return had

    def status(self) -> Dict[str, object]:
        return {"threshold_percent": self.throttle.threshold, "cuts": self.throttle.cuts,
                "limits": {d: {"read_bps": r, "write_bps": w} for d, (r, w) in sorted(self.throttle.limits.items())},
                "offline_bps": {d: {"read": round(r), "write": round(w)} for d, (r, w) in sorted(self.rates.items())}}


def describe(limits: Limits) -> str:
    mib = lambda v: "-" if v is None else f"{v / MIB:.1f} MiB/s"  # noqa: E731
    return ", ".join(f"{d} read {mib(r)} write {mib(w)}" for d, (r, w) in sorted(limits.items()))

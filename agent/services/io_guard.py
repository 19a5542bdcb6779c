"""Online's io pressure, acted on: offline work's block io limited in the kernel.

``services.io_throttle`` decides (pure); this service measures what offline
work moved per device (``isolation.cgroups.blockio``), feeds the loop, and
writes its limits on every offline cgroup: the reclaimed tree and each
reclaimed pod's cgroup (the same limit on each). The fast guard calls
``on_window`` every ``io_throttle.WINDOW_S``, the period ``on_period``.

The limits are not in the state file: Tidal starts unthrottled, so at start
(``lift_stale``) limits an earlier agent left are lifted, and on shutdown
(``lift_all``) this agent's are.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Optional, Tuple

from agent.isolation.cgroups.blockio import read_io_bytes, read_io_limits, write_io_limit
from agent.isolation.cgroups.detect import CgroupError
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
        self.failures = 0
        self.rates: Dict[str, Tuple[float, float]] = {}  # offline's bytes/s per device, the last window
        self._written: Dict[str, Limits] = {}  # cgroup -> the limits this agent put there
        self._last: Tuple[Optional[float], Dict[str, Tuple[int, int]]] = (None, {})
        self._lock = threading.Lock()

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
            rates = self.measure(now)
            if self.stopping() or not self.throttle.on_pressure(percent, rates):
                return False
            log.info("online io pressure %.1f%% (threshold %g%%): offline io limited to %s", percent,
                     self.throttle.threshold, describe(self.throttle.limits))
            self._enforce()
            return True

    def on_period(self, percent: Optional[float]) -> bool:
        """A period: the limits grow back once online has been quiet; True when they changed."""
        with self._lock:
            if self.stopping() or not self.throttle.on_period(percent):
                return False
            log.info("online io pressure is down: offline io %s", describe(self.throttle.limits) or "no longer limited")
            self._enforce()
            return True

    def _enforce(self) -> None:
        """Every offline cgroup holds the current limits; a pod that ended is forgotten."""
        paths = self.offline_cgroups()
        self._written = {p: v for p, v in self._written.items() if p in paths}
        for path in paths:
            written = self._written.setdefault(path, {})
            for device in sorted(set(written) | set(self.throttle.limits)):
                want = self.throttle.limits.get(device, (None, None))
                if written.get(device, (None, None)) == want:
                    continue
                try:
                    write_io_limit(self.driver, path, device, want)
                except CgroupError as exc:
                    self.failures += 1
                    log.warning("io limit: %s", exc)
                    continue
                if want == (None, None):
                    written.pop(device, None)
                else:
                    written[device] = want

    def lift_stale(self) -> List[str]:
        """At start: bandwidth limits on the offline cgroups that no agent now keeps (an earlier one
        stopped without lifting them) are lifted; the ``cgroup device`` pairs."""
        lifted = []
        if not self.driver.features.get("io"):
            return lifted
        with self._lock:
            for path in self.offline_cgroups():
                for device in read_io_limits(self.driver, path):
                    try:
                        write_io_limit(self.driver, path, device, (None, None))
                        lifted.append(f"{path} {device}")
                    except CgroupError as exc:
                        log.warning("io limit left by an earlier agent: %s", exc)
        return lifted

    def lift_all(self) -> None:
        """On shutdown: this agent's limits go with it."""
        with self._lock:
            self.throttle.limits = {}
            self._enforce()

    def status(self) -> Dict[str, object]:
        return {"threshold_percent": self.throttle.threshold, "cuts": self.throttle.cuts,
                "limits": {d: {"read_bps": r, "write_bps": w} for d, (r, w) in sorted(self.throttle.limits.items())},
                "offline_bps": {d: {"read": round(r), "write": round(w)} for d, (r, w) in sorted(self.rates.items())},
                "write_failures": self.failures}


def describe(limits: Limits) -> str:
    mib = lambda v: "-" if v is None else f"{v / MIB:.1f} MiB/s"  # noqa: E731
    return ", ".join(f"{d} read {mib(r)} write {mib(w)}" for d, (r, w) in sorted(limits.items()))

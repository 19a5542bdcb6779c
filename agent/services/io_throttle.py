"""The closed loop from online's io pressure to offline work's block io (pure: no I/O).

Offline work that streams from a disk online reads from fills the device's
queue: online's reads wait behind it, and no cpu or memory setting changes
that. PSI sees it: the share of wall time in which an online task waited on
the block layer (``io.pressure`` ``some`` of the online cgroups,
``reporter.pressure``; on a hybrid v1 host from the cgroup2 mirror).

The fast guard samples it over ``WINDOW_S``, with what the reclaimed tree
moved on each device in the same window. When the share reaches the
threshold, every device offline read or wrote on in that window gets a
bandwidth limit of ``CUT`` of its rate there (never under ``FLOOR``: offline
must still make progress to finish), in each direction it used: the reclaimed
tree's ``io.max`` on v2, ``blkio.throttle.read_bps_device`` and
``write_bps_device`` on v1. While the pressure stays, a window in which
offline still moved data on a limited device cuts ``CUT`` of the lower of its
rate and the limit, so the limit halves every such window until online stops
waiting. (The lower of the two: over a quarter-second window a limited job's
rate reads above its limit whenever one large request lands in it, since the
kernel counts a request's bytes when it passes the limit, and a cut from that
reading would hold the limit where it is; measured in the VM, a 1 MiB-read
scan held it at 1.5-1.9 MiB/s.) v1 throttles what a task submits: reads,
direct io, and on v2 also buffered writeback, which the kernel charges to the
cgroup that dirtied the pages; v1 writeback is issued by the kernel's flusher
and is not throttled.

It grows back slowly: after ``QUIET_PERIODS`` periods in a row under half
the threshold, each limit doubles per period, and once it reaches
``CEILING`` it is lifted. A limit on a device offline no longer uses costs
nothing and is lifted the same way.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from agent.services.quiet import QuietPeriods

MIB = 1 << 20
WINDOW_S = 0.25  # the guard's io pressure and rate samples span this much time
CUT = 0.5  # a limit of this share of offline's rate on the device in the window
FLOOR = 1 * MIB  # bytes/s: never below, offline keeps making progress
CEILING = 1 << 30  # bytes/s: a limit grown back to this is lifted
QUIET_PERIODS = 3

Rates = Mapping[str, Tuple[float, float]]  # device "major:minor" -> (read, write) bytes/s
Limits = Dict[str, Tuple[Optional[int], Optional[int]]]  # device -> (read, write) bytes/s; None: none


class IoThrottle:
    def __init__(self, threshold_percent: float) -> None:
        self.threshold = threshold_percent  # 0: off
        self.limits: Limits = {}
        self.cuts = 0
        self.last_trigger: Optional[float] = None  # the stall share (percent) of the last cut
        self._quiet = QuietPeriods(threshold_percent)

    def on_pressure(self, percent: Optional[float], rates: Optional[Rates]) -> bool:
        """A fast-guard window: True when a limit was set or lowered (the kernel must follow now)."""
        if self.threshold <= 0 or percent is None or percent < self.threshold or not rates:
            return False
        self._quiet.reset()
        changed = False
        for device, rate in rates.items():
            old = self.limits.get(device, (None, None))
            new = tuple(self._cut(old[i], rate[i]) for i in (0, 1))
            if new != old:
                self.limits[device] = new
                changed = True
        if changed:
            self.cuts += 1
            self.last_trigger = percent
        return changed

    @staticmethod
    def _cut(limit: Optional[int], rate: float) -> Optional[int]:
        """A direction's limit after a window at ``rate``: lowered where offline used the device that way."""
        if rate <= 0:
            return limit
        if limit is not None:
            rate = min(rate, limit)
        target = max(FLOOR, int(rate * CUT) // 4096 * 4096)
        return target if limit is None or target < limit else limit

    def set_threshold(self, percent: float) -> bool:
        """A new threshold (a policy's); True when turning the loop off lifted limits."""
        self.threshold = self._quiet.threshold = percent
        if percent <= 0 and self.limits:
            self.limits = {}
            return True
        return False

    def on_period(self, percent: Optional[float]) -> bool:
        """A period's sample: True when the limits grew (or were lifted)."""
        if not self.limits or self._quiet.sample(percent) < QUIET_PERIODS:
            return False
        grown: Limits = {}
        for device, pair in self.limits.items():
            pair = tuple(None if v is None or 2 * v >= CEILING else 2 * v for v in pair)
            if pair != (None, None):
                grown[device] = pair
        self.limits = grown
        return True

    def lifted(self, before: Limits) -> Limits:
        """The devices ``before`` limited that the current limits no longer name, as unlimited entries:
        what the kernel must be told to let go."""
        return {device: (None, None) for device in before if device not in self.limits}

"""The closed loop from online's memory pressure to offline work's memory (pure: no I/O).

Eviction waits a grace period; memory stalls hurt online work at once. So the
moment online's memory stall share (PSI, ``reporter.pressure``) reaches the
threshold, checked every fast-guard interval, offline work is throttled to
``CUT`` of what it holds now: the reclaimed tree's ``memory.high`` on v2
(its tasks are slowed and reclaim their own pages, page cache first, down to
it) and the memory capacity reported to offline schedulers. v1 has no
``memory.high`` and refuses a hard limit under what a group holds when it
cannot reclaim it (anonymous pages, no swap): there the throttle is the
reported capacity only (the reclaimed tree's soft limit of 0 already makes it
the first the kernel reclaims from). While the pressure stays,
every further fall in what offline holds is cut again by the same share, so
it keeps shrinking until online stops stalling (or eviction, after its grace,
takes whole workloads).

It grows back slowly: after ``QUIET_PERIODS`` periods in a row under half
the threshold, by ``STEP`` per period; once it reaches the unthrottled value
the throttle is gone.
"""

from __future__ import annotations

from typing import Optional

from agent.services.quiet import QuietPeriods

MIB = 1 << 20
CUT = 0.9  # throttle to this share of what offline holds when online stalls
FLOOR = 64 * MIB  # never below: the tree's own processes must run to reclaim
STEP = 256 * MIB  # growth per quiet period
QUIET_PERIODS = 3


class MemoryThrottle:
    def __init__(self, threshold_percent: float) -> None:
        self.threshold = threshold_percent  # 0: off
        self.limit: Optional[int] = None  # bytes offline may hold now; None: not throttled
        self.cuts = 0
        self._quiet = QuietPeriods(threshold_percent)

    def on_pressure(self, percent: Optional[float], offline_bytes: Optional[int]) -> bool:
        """A fast-guard sample; True when the limit was cut (the kernel must follow now)."""
        if self.threshold <= 0 or percent is None or percent < self.threshold or not offline_bytes:
            return False
        self._quiet.reset()
        target = max(FLOOR, int(offline_bytes * CUT) // MIB * MIB)
        if self.limit is not None and target >= self.limit:
            return False  # what offline holds has not fallen under the last cut yet
        self.limit = target
        self.cuts += 1
        return True

    def set_threshold(self, percent: float) -> bool:
        """A new threshold (a policy's); True when turning the loop off lifted a throttle."""
        self.threshold = self._quiet.threshold = percent
        if percent <= 0 and self.limit is not None:
            self.limit = None
            return True
        return False

    def on_period(self, percent: Optional[float], unthrottled: Optional[int]) -> bool:
        """A period's sample; True when the limit grew (or went)."""
        if self.limit is None or self._quiet.sample(percent) < QUIET_PERIODS:
            return False
        grown = self.limit + STEP
        self.limit = None if unthrottled is None or grown >= unthrottled else grown
        return True

    def apply(self, memory_bytes: int) -> int:
        """``memory_bytes`` (a limit or a capacity) as the throttle allows it."""
        return memory_bytes if self.limit is None else min(memory_bytes, self.limit)

"""The closed loop from online's cpu pressure to lending (pure: no I/O).

Utilisation misses a kind of interference: online work that is bursty and
wakes together (a request fanned out to its threads) waits on the runqueue
while its pool's average use stays well under saturation. PSI sees it: the
share of time in which an online task was runnable and waiting for a cpu
(``cpu.pressure`` ``some``, per online cgroup, ``reporter.pressure``).

The fast guard samples it over ``WINDOW_S`` (a single 50 ms interval is one
scheduling hiccup). When it reaches the threshold while cpus are carved out
of the shared pool for offline work, every lent cpu goes back at once (the
guard's ``shrink_now``, as when online saturates its pool).

Lending grows back slowly, and later each time it had to be taken back: no
growth for ``hold`` periods after a shrink nor while the pressure stays at or
over half the threshold; ``hold`` starts at ``HOLD_PERIODS`` and doubles each
time the pressure returns within twice the hold of the last release (up to
``MAX_HOLD_PERIODS``), and comes back to its start after ``RESET_PERIODS``
quiet periods. Without that memory, a load that stalls only when it has
fewer cpus would be lent to and taken back every few periods.
"""

from __future__ import annotations

from typing import Optional

from agent.services.quiet import QuietPeriods

WINDOW_S = 0.25  # the guard's pressure sample spans this much time
HOLD_PERIODS = 30  # no new lending this many periods after a pressure shrink (the sizer's peak window)
MAX_HOLD_PERIODS = 240
RESET_PERIODS = 600  # quiet periods after which the hold starts over


class CpuPressureLoop:
    def __init__(self, threshold_percent: float) -> None:
        self.threshold = threshold_percent  # 0: off
        self.shrinks = 0
        self.last_trigger: Optional[float] = None  # the stall share (percent) of the last shrink
        self.hold = HOLD_PERIODS  # the hold the next shrink imposes
        self.holding = 0  # periods left before lending may grow
        self._since_release: Optional[int] = None  # periods since the last hold ended
        self._quiet = QuietPeriods(threshold_percent)

    def set_threshold(self, percent: float) -> bool:
        """A new threshold (a policy's); turning the loop off ends a hold on lending (True then)."""
        self.threshold = self._quiet.threshold = percent
        if percent <= 0 and self.holding:
            self.holding = 0
            return True
        return False

    def on_pressure(self, percent: Optional[float], carved: bool) -> bool:
        """A fast-guard sample; True when every lent cpu must go back now."""
        if self.threshold <= 0 or percent is None or percent < self.threshold or not carved:
            return False
        if self._since_release is not None and self._since_release <= 2 * self.hold:
            self.hold = min(MAX_HOLD_PERIODS, self.hold * 2)  # it came back soon: wait longer next time
        self.holding = self.hold
        self._since_release = None
        self._quiet.reset()
        self.shrinks += 1
        self.last_trigger = percent
        return True

    def may_lend_more(self, percent: Optional[float]) -> bool:
        """A period's sample: whether the pool sizer may grow lending this period."""
        if self.threshold <= 0:
            return True
        if self.holding > 0:
            self.holding -= 1
            if self.holding == 0:
                self._since_release = 0
            return False
        if self._since_release is not None:
            self._since_release += 1
        quiet = self._quiet.sample(percent)
        if not quiet:
            return False
        if quiet >= RESET_PERIODS:
            self.hold = HOLD_PERIODS
        return True

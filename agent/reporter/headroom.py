"""How many cpus to lend to reclaimed work now (pure; the caller passes the clock).

The shared pool must hold the online work outside dedicated cpus: its
recent peak usage times (1 + buffer), never less than what shared requests
need. Everything else the policy may lend. Lending shrinks at once (online
demand rose: the reclaim pool is cut in the same period) and grows slowly
(at most ``ramp_cpus`` per period, and only after ``stable_periods`` quiet
periods), ignoring changes below the dead-band.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Optional

from contracts.headroom import DEFAULT_BUFFER, online_estimate


@dataclass
class ReclaimSizer:
    buffer: float = DEFAULT_BUFFER
    window: int = 30  # samples in the peak window
    ramp_cpus: int = 1
    stable_periods: int = 3
    saturation: float = 0.9  # online at >= 90% of its pool: give everything back at once
    deadband_millicpu: int = 100
    _history: Deque[int] = field(default_factory=deque)
    _shared_target: Optional[int] = None
    _quiet: int = 0

    def update(self, online_millicpu: int, shared_need: int, free_cpus: int, may_lend_more: bool = True) -> int:
        """The shared pool size (cpus) to keep; ``free_cpus`` - it may be lent. ``may_lend_more``
        False: the pool keeps its size or grows, never shrinks (online's cpu pressure holds lending)."""
        self._history.append(max(0, online_millicpu))
        while len(self._history) > self.window:
            self._history.popleft()
        peak = max(self._history)
        wanted = max(shared_need, math.ceil(online_estimate(peak, self.buffer) / 1000))
        current = self._shared_target if self._shared_target is not None else free_cpus
        self._shared_target = current
        if current and online_millicpu >= self.saturation * current * 1000:
            wanted = free_cpus  # saturated: the true demand is unknown, give all back now
        wanted = min(max(wanted, shared_need), free_cpus)
        if wanted > current:  # online needs more: shrink lending at once
            self._shared_target, self._quiet = wanted, 0
        elif wanted < current and (current - wanted) * 1000 > self.deadband_millicpu and may_lend_more:
            self._quiet += 1
            if self._quiet >= self.stable_periods:  # grow lending slowly
                self._shared_target = max(wanted, current - self.ramp_cpus)
        else:
            self._quiet = 0
            self._shared_target = current
        self._shared_target = min(max(self._shared_target, shared_need), free_cpus)
        return self._shared_target

    def force(self, shared_target: int, online_millicpu: int) -> None:
        """Online saturated between periods: keep ``shared_target`` cpus from now on."""
        self._history.append(max(0, online_millicpu))
        while len(self._history) > self.window:
            self._history.popleft()
        self._shared_target, self._quiet = shared_target, 0


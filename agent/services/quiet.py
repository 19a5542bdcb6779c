"""Periods in a row under half a pressure threshold: when a pressure loop may give back (pure: no I/O).

The cpu, memory and io loops (``cpu_pressure``, ``memory_throttle``, ``io_throttle``) act the moment
online's stall share reaches their threshold, and give back only after online has been quiet for a
while: under *half* the threshold, so a share that hovers at the threshold neither acts nor releases.
A period without a figure (no PSI sample yet) counts as quiet.
"""

from __future__ import annotations

from typing import Optional


class QuietPeriods:
    def __init__(self, threshold_percent: float) -> None:
        self.threshold = threshold_percent
        self.count = 0

    def reset(self) -> None:
        """The loop acted: the quiet count starts over."""
        self.count = 0

    def sample(self, percent: Optional[float]) -> int:
        """A period's stall share; the periods in a row under half the threshold, this one included
        (0: this one was not quiet)."""
        if percent is not None and percent >= self.threshold / 2:
            self.count = 0
        else:
            self.count += 1
        return self.count

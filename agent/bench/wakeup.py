"""Hold the cpus' wake-up latency low for the length of a benchmark (PM QoS).

Writing a 32-bit number of microseconds to ``/dev/cpu_dma_latency`` and
keeping the file open is the kernel's interface for "do not let any cpu sleep
in an idle state that takes longer than this to leave"
(Documentation/admin-guide/pm/cpuidle.rst, "Power Management Quality of
Service for CPUs"); the request ends when the file is closed, so a crashed
benchmark leaves nothing behind. tuned's latency profiles do the same.

Why the network benchmark wants it: on a virtual machine an idle vCPU halts,
and another vCPU waking it (an IPI, or the kick that ends a paravirtual
spinlock wait) goes through the hypervisor. On this project's test machine that
took 1-8 ms now and then (traced: ``finish_wait`` spinning on a socket's wait
queue lock for 3.6-8.5 ms right after the task was woken from the other vCPU),
which is the hypervisor's latency, not the network's. With a 0 µs request the
idle vCPU polls instead of halting and is woken without an IPI. The waker then
drops the wait-queue lock before the wakee reaches it, so the spinlock waits
that needed a kick mostly go too: in one traced 4 s round, lock waits over
200 µs fell from 27 (50 ms in all) to 4 (1.9 ms).
"""

from __future__ import annotations

import os
import struct
from typing import Any, Dict, Optional

PM_QOS_DEVICE = "/dev/cpu_dma_latency"


class WakeupLatencyHold:
    """``with WakeupLatencyHold(0) as hold: ...``; ``hold.describe()`` says what was held (or why not)."""

    def __init__(self, max_us: int = 0, device: str = PM_QOS_DEVICE) -> None:
        if max_us < 0:
            raise ValueError(f"wake-up latency {max_us} µs: must be 0 or more")
        self.max_us = max_us
        self.device = device
        self.fd: Optional[int] = None
        self.reason = ""

    def __enter__(self) -> "WakeupLatencyHold":
        try:
            self.fd = os.open(self.device, os.O_WRONLY)
            os.write(self.fd, struct.pack("=i", self.max_us))
        except OSError as exc:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
            self.reason = f"{self.device}: {exc.strerror or exc}"
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def describe(self) -> Dict[str, Any]:
        if self.held:
            return {"held": True, "max_us": self.max_us}
        return {"held": False, "reason": self.reason or "not requested"}

"""Online memory's protection: ``memory.low`` of every cgroup that holds online processes (v2).

Offline work's pages go first: memory under ``memory.low`` is reclaimed only when nothing unprotected is
left. Each period (``protect``, from the usage sampling) works out the figures; the desired tree writes
them (``isolation.cgroups.desired``, through the Reconciler), each cgroup above a protected one getting
the sum below it.
"""

from __future__ import annotations

from typing import Dict, List

from agent.qrm.model import LOCAL, QoS
from agent.reporter.capacity import MIB

ONLINE_TREES = ("system", "dedicated", "shared")  # latency-sensitive work: its memory is protected
PROTECTION_STEP = 64 * MIB


class MemoryProtection:
    def __init__(self, owner, enforcement) -> None:
        self.owner = owner
        self.enforcement = enforcement
        self.driver = enforcement.driver
        self._protection: Dict[str, int] = {}  # cgroup holding online processes -> memory.low

    def protect(self) -> int:
        """``memory.low`` (v2) of each cgroup that holds online processes: what it uses, rounded up to
        ``PROTECTION_STEP``; raised as soon as its use passes it, lowered only once its use is two steps
        under (few writes). Those cgroups are Tidal's system tree, each dedicated and shared workload's
        leaf, and each online pod's containers (its cgroup where none is known); ``desired_tree`` gives
        every cgroup above them the sum below it. Protection must reach the cgroups the pages are charged
        to: the kernel bounds a cgroup's protection by its parent's, and a cgroup with no ``memory.low``
        of its own has none (unless cgroup2 is mounted with ``memory_recursiveprot``, which systemd does
        and a bare mount does not). Memory under ``memory.low`` is reclaimed only when nothing
        unprotected is left: offline work's pages go first. Returns what the online trees hold together,
        page cache included."""
        base = self.enforcement.base
        total = sum(self.driver.memory_usage_bytes(f"{base}/{tree}") or 0 for tree in ONLINE_TREES)
        if not self.driver.features.get("memory_protection"):
            return total  # v1: no memory.low to write
        protection: Dict[str, int] = {}
        for path in self.cgroups():
            used = self.driver.memory_usage_bytes(path)
            if used is None:
                continue
            target = -(-used // PROTECTION_STEP) * PROTECTION_STEP
            old = self._protection.get(path)
            protection[path] = target if old is None or target > old or target < old - 2 * PROTECTION_STEP else old
        self._protection = protection
        return total

    def cgroups(self) -> List[str]:
        base = self.enforcement.base
        paths = [f"{base}/system"]  # system workloads of Tidal's own share it
        for alloc in self.owner.state.allocations if self.owner.state is not None else ():
            if alloc.qos is QoS.RECLAIMED or (alloc.qos is QoS.SYSTEM and alloc.source == LOCAL):
                continue
            cgroups = self.enforcement.cgroups_of(alloc)
            paths += cgroups if alloc.source == LOCAL else (cgroups[1:] or cgroups[:1])
        return paths

    def current(self) -> tuple:
        """(cgroup, memory.low) of every protected cgroup, as the desired tree writes them."""
        return tuple(sorted(self._protection.items()))

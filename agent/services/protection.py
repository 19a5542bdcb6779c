"""Online memory's protection: ``memory.low`` of the cgroups that hold online processes (v2).

Offline work's pages go first: memory under ``memory.low`` is reclaimed only when nothing unprotected is
left. Each period (``protect``, from the usage sampling) measures Tidal's online trees and each online
pod; the desired tree writes the figures (``isolation.cgroups.desired``, through the Reconciler), each
cgroup above a measured one getting the sum below it and each online cgroup below one ``max`` (its share).
"""

from __future__ import annotations

from typing import Callable, Dict, List

from agent.reporter.capacity import MIB

ONLINE_TREES = ("system", "dedicated", "shared")  # latency-sensitive work: its memory is protected
PROTECTION_STEP = 64 * MIB


class MemoryProtection:
    def __init__(self, enforcement, cgroups: Callable[[], List[str]]) -> None:
        """``cgroups()``: where online work lives, Tidal's online trees first and then each online pod's
        own cgroup (``Usage.online_cgroups``)."""
        self.enforcement = enforcement
        self.driver = enforcement.driver
        self.cgroups = cgroups
        self._protection: Dict[str, int] = {}  # measured cgroup -> memory.low

    def protect(self) -> int:
        """``memory.low`` (v2) of the cgroups whose use is measured each period: Tidal's online trees
        (system, dedicated, shared) and each online pod's own cgroup. Each gets what it uses, rounded up
        to ``PROTECTION_STEP``; raised as soon as its use passes it, lowered only once its use is two
        steps under (few writes). ``desired_tree`` gives every cgroup above them the sum below it (the
        kernel bounds a cgroup's protection by its parent's), and the online cgroups below them (each
        workload's leaf, each pod's containers: where the pages are charged) ``max``: a share of their
        parent's in proportion to what they use, which their parent's figure covers. A cgroup with no
        ``memory.low`` of its own would have none unless cgroup2 is mounted with
        ``memory_recursiveprot`` (systemd does, a bare mount does not); ``max`` below a measured figure
        is that rule written out, at a read per tree and pod a period instead of one per workload.
        Memory under ``memory.low`` is reclaimed only when nothing unprotected is left: offline work's
        pages go first. Returns what the online trees hold together, page cache included."""
        base = self.enforcement.base
        trees = [f"{base}/{tree}" for tree in ONLINE_TREES]
        if not self.driver.features.get("memory_protection"):  # v1: no memory.low to write
            return sum(self.driver.memory_usage_bytes(path) or 0 for path in trees)
        measured = {path: self.driver.memory_usage_bytes(path) for path in self.cgroups()}
        total = sum(measured.get(path) or 0 for path in trees)
        protection: Dict[str, int] = {}
        for path, used in measured.items():
            old = self._protection.get(path)
            if used is None or (not used and old is None):
                continue  # gone, or nothing to protect yet
            target = -(-used // PROTECTION_STEP) * PROTECTION_STEP
            protection[path] = target if old is None or target > old or target < old - 2 * PROTECTION_STEP else old
        self._protection = protection
        return total

    def current(self) -> tuple:
        """(cgroup, memory.low) of every protected cgroup, as the desired tree writes them."""
        return tuple(sorted(self._protection.items()))

"""Where processes live: the one road for moving and signalling them, as the Reconciler is for cgroup files.

Services never move or kill a process through a driver themselves (``tests/unit/test_layering.py``
holds them to it); they ask this module, which knows the cgroups of the one driver the agent built:

* ``attach(path, pid)``: a process into a workload's cgroup (every hierarchy, v1's cgroup2 mirror too);
* ``join_offline(path, pid)``: a process into an offline system's own cgroup, from the hierarchies'
  roots (``--offline-cgroup``; accounting hierarchies only on v1);
* ``kill(path, sig)``: signal every process of a cgroup and its descendants (evictions);
* ``pin_self(cpus)``: the agent's own threads onto cpus by affinity, where it stays in a cgroup that is
  not Tidal's (its systemd unit's: leaving would lose the unit's limits);
* ``procs(path)``, ``offline_procs(path)``: who is there.
"""

from __future__ import annotations

import os
from typing import Iterable, List


class Membership:
    def __init__(self, driver) -> None:
        self.driver = driver
        self._rooted = None

    @property
    def rooted(self):
        if self._rooted is None:
            self._rooted = self.driver.root_view()
        return self._rooted

    def attach(self, path: str, pid: int) -> None:
        self.driver.move(path, pid)

    def join_offline(self, path: str, pid: int) -> None:
        self.rooted.join_offline(path, pid)

    def kill(self, path: str, sig: int) -> List[int]:
        return self.driver.kill(path, sig)

    def procs(self, path: str) -> List[int]:
        return self.driver.procs(path)

    def offline_procs(self, path: str) -> List[int]:
        return self.rooted.procs_anywhere(path)

    @staticmethod
    def pin_self(cpus: Iterable[int]) -> int:
        """Every thread of this process onto ``cpus`` (threads made later inherit it); the count pinned."""
        wanted, pinned = set(cpus), 0
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), wanted)
                pinned += 1
            except OSError:
                pass  # a thread that ended meanwhile
        return pinned

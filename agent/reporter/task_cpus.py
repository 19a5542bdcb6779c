"""Where offline work ran, per cpu, without per-cpu cgroup counters (cgroup v2).

cgroup v1's ``cpuacct.usage_percpu`` says how much of a tree's cpu time each
cpu gave it; cgroup v2 has no such file (``cpu.stat`` is one total). What the
kernel does keep per thread is its run time in ns (``/proc/<pid>/task/<tid>/
schedstat``, first field) and the cpu it last ran on (``stat`` field 39). Each
period, every thread's new run time is charged to that cpu; the charges are
then scaled to the tree's own ``cpu.stat`` total (which also counts threads
that exited between two samples). A thread that migrated within the period is
charged wholly to where it ended, which is the estimate's error; ``tidal bench
numa-usage`` measures it against v1's per-cpu counters on the same load.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, Optional, Tuple

ThreadKey = Tuple[int, int]  # (tid, start time): a reused tid is a new thread


def read_thread(pid: int, tid: int, proc: str = "/proc") -> Optional[Tuple[int, int, int]]:
    """(start time in ticks, last cpu, run time in ns) of one thread, or ``None`` when it is gone."""
    base = f"{proc}/{pid}/task/{tid}"
    try:
        with open(f"{base}/stat", "rb") as handle:
            stat = handle.read()
        with open(f"{base}/schedstat", "rb") as handle:
            run_ns = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    # the command name may hold spaces and parentheses: fields are counted after its last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19]), int(fields[36]), run_ns  # starttime (22), processor (39)
    except (ValueError, IndexError):
        return None


def threads_of(pids: Iterable[int], proc: str = "/proc") -> Iterable[Tuple[int, int]]:
    for pid in pids:
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            if tid.isdigit():
                yield pid, int(tid)


class TaskCpuAttribution:
    """Per-cpu run time of a set of processes, charged thread by thread to the cpu each last ran on."""

    def __init__(self, pids: Callable[[], Iterable[int]], proc: str = "/proc") -> None:
        self._pids = pids
        self._proc = proc
        self._last: Dict[ThreadKey, int] = {}
        self._primed = False

    def sample(self) -> Dict[int, int]:
        """ns charged to each cpu since the previous call (the first call charges nothing)."""
        charged: Dict[int, int] = {}
        seen: Dict[ThreadKey, int] = {}
        first = not self._primed
        self._primed = True
        for pid, tid in threads_of(self._pids(), self._proc):
            read = read_thread(pid, tid, self._proc)
            if read is None:
                continue
            start, cpu, run_ns = read
            key = (tid, start)
            seen[key] = run_ns
            before = self._last.get(key)
            if before is None and first:
                continue
            delta = run_ns - (before or 0)  # a thread new since the last sample: all of its run time
            if delta > 0:
                charged[cpu] = charged.get(cpu, 0) + delta
        self._last = seen
        return charged


def scale_to(charged: Dict[int, int], total: float) -> Dict[int, float]:
    """The charges, scaled so that they sum to ``total`` (the tree's own counter over the same time)."""
    whole = sum(charged.values())
    if whole <= 0 or total <= 0:
        return {}
    return {cpu: ns * total / whole for cpu, ns in charged.items()}

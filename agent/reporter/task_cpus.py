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


def _read(path: str) -> Optional[bytes]:
    """A small /proc file's bytes, or ``None`` when it is gone (one open, read and close: no file object)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)


def _run_ns(base: str) -> Optional[int]:
    text = _read(f"{base}/schedstat")
    try:
        return int(text.split(None, 1)[0]) if text else None
    except ValueError:
        return None


def _start_and_cpu(base: str) -> Optional[Tuple[int, int]]:
    stat = _read(f"{base}/stat")
    if not stat:
        return None
    # the command name may hold spaces and parentheses: fields are counted after its last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19]), int(fields[36])  # starttime (22), processor (39)
    except (ValueError, IndexError):
        return None


def read_thread(pid: int, tid: int, proc: str = "/proc") -> Optional[Tuple[int, int, int]]:
    """(start time in ticks, last cpu, run time in ns) of one thread, or ``None`` when it is gone."""
    base = f"{proc}/{pid}/task/{tid}"
    run_ns, stat = _run_ns(base), _start_and_cpu(base)
    return None if run_ns is None or stat is None else (stat[0], stat[1], run_ns)


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
    """Per-cpu run time of a set of processes, charged thread by thread to the cpu each last ran on.

    A thread's ``schedstat`` is read first; only one that ran since the last sample has its ``stat`` read
    (the cpu it ran on, and its start time, which tells a reused tid from the thread seen before). An idle
    thread costs one read a period: most of a batch job's threads wait most of the time."""

    def __init__(self, pids: Callable[[], Iterable[int]], proc: str = "/proc") -> None:
        self._pids = pids
        self._proc = proc
        self._last: Dict[int, Tuple[ThreadKey, int]] = {}  # tid -> (its key, run time at the last sample)
        self._primed = False

    def sample(self) -> Dict[int, int]:
        """ns charged to each cpu since the previous call (the first call charges nothing)."""
        charged: Dict[int, int] = {}
        seen: Dict[int, Tuple[ThreadKey, int]] = {}
        first = not self._primed
        self._primed = True
        for pid, tid in threads_of(self._pids(), self._proc):
            base = f"{self._proc}/{pid}/task/{tid}"
            run_ns = _run_ns(base)
            if run_ns is None:
                continue
            known = self._last.get(tid)
            if known is not None and known[1] == run_ns:
                seen[tid] = known  # it has not run since: nothing to charge, its cpu not needed
                continue
            stat = _start_and_cpu(base)
            if stat is None:
                continue
            start, cpu = stat
            key = (tid, start)
            seen[tid] = (key, run_ns)
            if known is not None and known[0] != key:
                known = None  # the tid is another thread's now
            if known is None and first:
                continue
            delta = run_ns - (known[1] if known else 0)  # a thread new since the last sample: all of its run time
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

"""Reclaimed work that runs in the kernel is kept off online's shared cpus (pure: no I/O).

Reclaimed work takes the shared pool's idle time at idle priority (``cpu.idle``): an online task that
wakes up preempts it at once, while it runs in user mode. In the kernel it is another matter. The page
faults of a job growing its memory, its page-cache reads and the reclaim it does at its memory limit run
in its own context, and on a kernel without full preemption (``PREEMPT_NONE`` or ``PREEMPT_VOLUNTARY``:
most distributions' default) a task in the kernel runs on until its next preemption point whatever its
priority, holding the locks it took. ``bench memory-isolation`` measured what that costs a service that
shares its cpu with such a job (90% of its cpu time in the kernel) on v1: p99 0.6-9.7x alone over 8
runs, median 2.5x; 0.80-1.09x over 5 with the job kept off the service's cpu.

So a reclaimed workload whose kernel time (``cpuacct.stat`` ``system`` on v1, ``cpu.stat``
``system_usec`` on v2) reaches ``KERNEL_SHARE`` of its cpu time over a period, and at least
``MIN_KERNEL_MILLICPU``, is **confined**: its cpuset leaves out the shared pool's cpus and keeps the
reclaim pool's (lent cpus). Where nothing is lent it waits on the shared pool at the minimum quota
(the reserved pool is never lent: ``qrm.assignment``); ``MIN_KERNEL_MILLICPU`` is above that quota, so
what a waiting workload does never looks heavy. Where it has lent cpus it stays confined until
``RELEASE_PERIODS`` periods in a row under the mark: a job's phases (load, compute) last minutes, and
each move costs it its cache. Where it waits, it is released to try again after a **hold** that starts
at ``FIRST_HOLD_PERIODS`` and doubles each time it is confined again, up to ``RELEASE_PERIODS``; the
hold starts over once the workload has run ``RELEASE_PERIODS`` periods in a row free. Waiting never
takes the kernel work away, it only puts it off: a job's kernel phase (a JVM's start: a few cpu-seconds)
costs online the same periods on the shared cpus whenever it runs, so a long hold bought nothing for a
phase that ends, and stalled the workload (a YARN container's JVM waited 50-65 s for each start). The
doubling keeps the long hold for work that stays in the kernel: one heavy period in ``RELEASE_PERIODS``
once it has been confined five times (``bench memory-isolation``, a job in the kernel from its start:
online's p99 1.46x alone in 60 s rounds with the doubling hold, 1.49x with the flat one; docs/capacity.md).
A new workload starts confined, on probation, for its first ``PROBATION_PERIODS`` periods, where a
lent cpu can take it: a job's first seconds (loading its input, building its tables) are often its
most kernel-bound, and a task framework's retry is a new workload each time. A cpu-bound job (user
time) then harvests the shared pool's idle time. With nothing lent, a new workload is not held at the
minimum quota for what it has not shown: it harvests and is judged on its first periods.

Waiting has its price, which the agent shows: each confined workload's wait at the minimum quota so far
and the workload-seconds of all waits (``wait``; ``tidal status``, the metrics). A JVM that starts as a
YARN container runs in the kernel for its first seconds and, on a node with nothing lent, waits there
for its holds (docs/benchmarks: YARN through a compressed day).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

KERNEL_SHARE = 0.3  # of a workload's own cpu time, spent in the kernel
# and at least this much kernel time per second: a sleeping job is not worth a move, and a waiting one (at the
# minimum quota, 10 millicpu: isolation.cgroups.desired.MIN_QUOTA_US) must never look heavy for waiting
MIN_KERNEL_MILLICPU = 20
RELEASE_PERIODS = 60
FIRST_HOLD_PERIODS = 4  # a waiting workload's first hold; doubled at each confinement after, to RELEASE_PERIODS
PROBATION_PERIODS = 4

Times = Tuple[int, int]  # (user ns, system ns), cumulative


class KernelWork:
    def __init__(self) -> None:
        self.confined: Dict[str, int] = {}  # workload -> periods in a row under the mark
        self.kernel_millicpu: Dict[str, int] = {}  # the last period's kernel time per reclaimed workload
        self.confinements = 0
        self.seen: Dict[str, int] = {}  # workload -> periods it was known (probation ends at PROBATION_PERIODS)
        self._last: Dict[str, Tuple[float, Times]] = {}
        self._tree: Optional[Tuple[float, Times]] = None  # the reclaimed tree's last reading (quiet())
        self.waiting_since: Dict[str, float] = {}  # confined workload with no lent cpu -> since when (wait())
        self.waited_seconds = 0.0  # workload-seconds at the minimum quota, all waits together
        self._wait_at: Optional[float] = None
        self.hold: Dict[str, int] = {}  # confined workload -> the periods it waits under the mark (nothing lent)
        self._next_hold: Dict[str, int] = {}  # workload confined before -> its next hold
        self._free: Dict[str, int] = {}  # workload with a next hold, not confined -> periods free in a row

    def quiet(self, now: float, tree: Optional[Times]) -> bool:
        """Whether the reclaimed tree as a whole (``tree``: its cumulative times now) spent under
        ``MIN_KERNEL_MILLICPU`` in the kernel since the last period: then none of its workloads is heavy
        this period, and their own figures need not be read (``observe``'s ``unread``)."""
        last, self._tree = self._tree, (None if tree is None else (now, tree))
        if tree is None or last is None or now <= last[0]:
            return False
        return max(0, tree[1] - last[1][1]) / 1e6 / (now - last[0]) < MIN_KERNEL_MILLICPU

    def read_before(self, name: str) -> bool:
        """Whether a reading of ``name`` is kept (one left unread is judged against it later)."""
        return name in self._last

    def observe(self, now: float, times: Mapping[str, Optional[Times]], unread=frozenset(), lent: bool = True) -> bool:
        """A period's cpu times of the reclaimed workloads; True when the confined set changed.
        ``unread``: those of them not read this period, their tree being ``quiet``: under the mark, and
        their last reading kept, so the next one spans the whole time since (a rate, not a sum).
        ``lent``: whether reclaimed work has lent cpus now; without, a confined workload waits at the
        minimum quota and is released after its hold rather than ``RELEASE_PERIODS``."""
        changed = False
        last, self._last = self._last, {}
        self.kernel_millicpu = {}
        for name, value in times.items():
            self.seen[name] = self.seen.get(name, 0) + 1
            if self.seen[name] == PROBATION_PERIODS:
                changed = True  # off probation: confined below, or free to harvest
            if name in unread and name in last:
                self._last[name] = last[name]
                heavy = False
            else:
                if value is None:
                    continue
                self._last[name] = (now, value)
                before = last.get(name)
                if before is None or now <= before[0]:
                    continue
                span = now - before[0]
                user = max(0, value[0] - before[1][0]) / 1e6 / span
                kernel = max(0, value[1] - before[1][1]) / 1e6 / span
                self.kernel_millicpu[name] = round(kernel)
                heavy = kernel >= MIN_KERNEL_MILLICPU and kernel >= KERNEL_SHARE * (user + kernel)
            if heavy:
                if name not in self.confined:
                    self.confinements += 1
                    changed = True
                    self.hold[name] = self._next_hold.get(name, FIRST_HOLD_PERIODS)
                    self._next_hold[name] = min(2 * self.hold[name], RELEASE_PERIODS)
                    self._free.pop(name, None)
                self.confined[name] = 0
            elif name in self.confined:
                self.confined[name] += 1
                if self.confined[name] >= (RELEASE_PERIODS if lent else self.hold.get(name, FIRST_HOLD_PERIODS)):
                    del self.confined[name]
                    self.hold.pop(name, None)
                    changed = True
            elif name in self._next_hold:  # free since its last release: the hold starts over after a while
                self._free[name] = self._free.get(name, 0) + 1
                if self._free[name] >= RELEASE_PERIODS:
                    del self._next_hold[name], self._free[name]
        for name in [n for n in self.confined if n not in times]:  # ended
            del self.confined[name]
            self.hold.pop(name, None)
            changed = True
        self.seen = {n: c for n, c in self.seen.items() if n in times}
        self._next_hold = {n: h for n, h in self._next_hold.items() if n in times}
        self._free = {n: c for n, c in self._free.items() if n in times}
        return changed

    def wait(self, now: float, names) -> None:
        """``names``: the confined workloads that have no lent cpu now and so wait at the minimum quota.
        The time since the last call is counted to those that waited then; each one's wait runs from when
        it was first named without a break."""
        last, self._wait_at = self._wait_at, now
        if last is not None and now > last:
            self.waited_seconds += (now - last) * len(self.waiting_since)
        self.waiting_since = {n: self.waiting_since.get(n, now) for n in names}

    def waiting(self) -> Dict[str, float]:
        """Each waiting workload's wait so far (to the last period), seconds."""
        now = self._wait_at or 0.0
        return {n: round(max(0.0, now - since), 1) for n, since in sorted(self.waiting_since.items())}

    def names(self) -> frozenset:
        """The workloads confined for their kernel time."""
        return frozenset(self.confined)

    def confined_of(self, workloads) -> frozenset:
        """Of the reclaimed ``workloads``, those to keep off online's idle cpus: confined, or on probation."""
        return frozenset(n for n in workloads if n in self.confined or self.seen.get(n, 0) < PROBATION_PERIODS)

"""Harvest: what online leaves idle, sized and published.

Every period, from what ``services.usage`` measures: protect online's memory (``services.protection``);
resize the reclaim pool (``ReclaimSizer``); estimate the reclaimed capacity (``CapacityEstimator``; both use
THE headroom rule, ``contracts.headroom``); publish it (generation, long-pollers, the push to offline
agents) when it changes. Between periods the fast guard (``services.guard``) takes back what online needs
at once.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any, Callable, Dict, Optional

from agent.lending import OFFLINE, NodeLending
from agent.qrm.policy import State, _layout
from agent.reporter.capacity import MEMORY_STEP, MIB, Capacity, CapacityEstimator, HourlyHistory
from agent.reporter.headroom import ReclaimSizer
from agent.reporter.pressure import PressureFiles, PressureMeter
from agent.isolation.cgroups.desired import RECLAIMED_HIGH_SHARE
from agent.isolation.cgroups.driver import cpu_times_ns
from agent.qrm.model import LOCAL, QoS
from agent.services.enforcement import Enforcement
from agent.services.cpu_pressure import CpuPressureLoop
from agent.services.io_guard import IoGuard
from agent.services.kernel_work import KernelWork
from agent.services.memory_throttle import MemoryThrottle
from agent.services.guard import FastGuard, online_wait
from agent.services.owner import StateOwner
from agent.services.protection import MemoryProtection
from agent.services.usage import Usage

log = logging.getLogger("tidal.agent")

# the reclaimed tree's cpu cap and memory max follow the estimate once it moves past the larger of a share
# of them and a floor (Harvest.limits); offline schedulers are told whole cores and 512 MiB steps anyway
LIMIT_BAND = 0.02
LIMIT_FLOOR_MILLICPU = 50
LIMIT_FLOOR_BYTES = 32 * MIB


class Harvest:
    def __init__(self, owner: StateOwner, enforcement: Enforcement, lending: NodeLending, config,
                 counters: Dict[str, int], history_path: str, usage: Usage, protection: MemoryProtection) -> None:
        self.owner = owner
        self.enforcement = enforcement
        self.driver = enforcement.driver
        self.lending = lending
        self.config = config
        self.counters = counters
        self.usage = usage  # what work uses (services.usage): every figure below is sized from it
        self.protection = protection  # memory.low of online's cgroups
        self.sizer = ReclaimSizer()
        self.estimator = CapacityEstimator(history=HourlyHistory(history_path))
        self.capacity: Optional[Capacity] = None
        self.generation = 0
        self.updated_at = time.time()
        self.on_change: Optional[Callable[[], None]] = None  # the push to offline agents
        self._published_node = None
        self._saved_hour = None
        # online's memory stall share (PSI), every period: a cause of eviction (services.eviction), and the
        # throttle's way back; the fast guard has its own meter, for the throttle's cut
        # read from files kept open (pread: a third of an open, read and close), and only where the node's
        # own stall total moved since the last sample (PressureMeter's gate), or its avg10 is 10 s old
        locate = getattr(self.driver, "membership_dir", None)
        files = self.pressure_files = PressureFiles(locate) if locate is not None else None

        def meter(resource: str) -> PressureMeter:
            if files is None:  # a driver without cgroup2 directories (a test's fake) reads its own way
                return PressureMeter(self.driver.pressure, self.usage.online_cgroups, resource)
            return PressureMeter(files.read, self.usage.online_cgroups, resource, files=files, refresh_s=10.0,
                                 gate=lambda: files.node_total(resource))

        self.memory_pressure = meter("memory")
        self.throttle = MemoryThrottle(getattr(config, "memory_pressure_threshold", 0.0))
        # online's cpu stall share: the fast guard takes lent cpus back on it, the period holds lending
        # (services.cpu_pressure)
        self.cpu_pressure = meter("cpu")
        self.cpu_loop = CpuPressureLoop(getattr(config, "cpu_pressure_threshold", 0.0))
        # online's io stall share: the fast guard limits offline's block io on it, the period lifts the
        # limits slowly (services.io_guard); on v1, or with no io controller, it is shown only
        self.io_pressure = meter("io")
        # reclaimed workloads that run in the kernel: off online's idle cpus (services.kernel_work)
        self.kernel_work = KernelWork()
        self.io_guard = IoGuard(self.driver, self.usage.io_cgroups, getattr(config, "io_pressure_threshold", 0.0),
                                stopping=lambda: self.guard.stopping())
        self.raw_memory: Optional[int] = None  # the reclaimed memory capacity before the throttle
        self._held_limits: Optional[tuple] = None  # the kernel's limits as last given (limits())
        self.guard = FastGuard(self)  # between periods: online gets cpus and memory back at once

    def start(self) -> Optional[str]:
        """Ready to sample; a warning line when the usage history was unusable."""
        self.usage.start()
        return self.estimator.history.load()

    # ---- every period ------------------------------------------------------------------------

    def sample(self, now: float, epoch: float, workload_paths) -> bool:
        """One usage sample, observed by the estimator (False when there is none yet: the first period)."""
        for meter in (self.memory_pressure, self.cpu_pressure, self.io_pressure):
            meter.sample(now)
        sample = self.usage.sample(now, workload_paths)
        if sample is None:
            return False
        usage = self.usage
        usage.memory(self.protection.protect())
        self.estimator.observe(now, epoch, usage.online_millicpu, usage.online_bytes, usage.online_per_node(sample, now))
        hour = self.estimator.history.key(epoch)
        if self._saved_hour != hour or int(now) % 60 == 0:
            self._saved_hour = hour
            try:
                self.estimator.history.save()
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop the loop
                log.warning("cannot save usage history: %s", exc)
        return True

    def resize(self) -> None:
        """The reclaim pool's size from online's demand (the sizer); lent: all but what shared needs."""
        owner = self.owner
        lay = _layout(owner.topology, owner.state)
        if self.lending.current.state == OFFLINE:
            shared_target = lay.shared_need  # lent: everything not needed goes to offline
        else:
            shared_target = self.sizer.update(self.usage.online_millicpu, lay.shared_need, len(lay.free),
                                              self.cpu_loop.may_lend_more(online_wait(self.cpu_pressure)))
        lendable = len(owner.pools().lendable)
        target = lendable + max(0, len(lay.free) - shared_target)
        if target != owner.state.reclaim_cpus:
            owner.commit(owner.state.with_reclaim_cpus(target))

    # ---- the reclaimed capacity --------------------------------------------------------------

    def memory_total(self) -> int:
        """The node's memory: /proc/meminfo on the live host (node meminfo can lag behind hot-plugged
        memory, as on this project's VMs), or a tighter limit above Tidal's tree (``memory_view``);
        else the NUMA nodes'."""
        if self.config.root == "/":
            view = self.usage.memory_view()
            if view is not None:
                return view[0]
        return sum(n.memory_bytes or 0 for n in self.owner.topology.numa_nodes)

    def allocatable(self, state: State) -> tuple:
        """(millicpu, bytes) offline could hold if online used nothing."""
        topo = self.owner.topology
        pool = self.owner.pools(state)
        lay = _layout(topo, state)
        if self.enforcement.harvest:
            cpus = len(lay.free - set(pool.held_back)) + len(lay.reserved) + len(pool.lendable)
        else:
            cpus = len(pool.reclaimed)
        total = self.memory_total()
        reserve = self.config.memory_reserved_bytes
        if reserve is None:
            reserve = max(1024 * MIB, total // 20)
        return cpus * 1000, max(0, total - reserve)

    def lent_whole(self, state: State) -> Capacity:
        """Lent (``Offline``): the whole machine less the reserved pool, cpu and memory, whatever
        online used before: online work is gone, and offline may fill the node."""
        topo = self.owner.topology
        lay = _layout(topo, state)
        millicpu = max(0, len(topo.online_cpus()) - len(lay.reserved)) * 1000
        memory = self.allocatable(state)[1] // MEMORY_STEP * MEMORY_STEP
        total_cpus = max(1, len(topo.online_cpus()))
        numa = tuple((node.id, len(node.cpus) * millicpu // total_cpus // 1000 * 1000,
                      int(memory * len(node.cpus) / total_cpus) // MEMORY_STEP * MEMORY_STEP)
                     for node in topo.numa_nodes)
        return Capacity(millicpu, memory, "lent", numa, limit_millicpu=millicpu)

    def estimate(self, state: State, now: float, epoch: float) -> Capacity:
        topo = self.owner.topology
        if self.lending.current.state == OFFLINE:
            return self.lent_whole(state)
        requests = (state.totals.shared_millicpu, self.usage.online_bytes)
        allocatable = self.allocatable(state)
        numa = []
        if topo.numa_nodes:
            total_cpus = max(1, len(topo.online_cpus()))
            for node in topo.numa_nodes:
                share = len(node.cpus) / total_cpus
                numa.append((node.id, int(allocatable[0] * share), int(allocatable[1] * share)))
        capacity = self.estimator.estimate(now, epoch, allocatable, requests, tuple(numa))
        if not self.enforcement.harvest:
            # without idle-priority harvest, offline owns the reclaim pool's cpus, which the
            # sizer already fits to online demand; only memory comes from the estimate
            capacity = Capacity(allocatable[0], capacity.memory_bytes, capacity.source, capacity.numa)
        # the kernel's limit is the unrounded estimate: offline schedulers are told whole steps (512 MiB)
        # so that their figure holds still, the kernel need not hide the rest of a step from what runs
        kernel = capacity.kernel_memory_bytes if capacity.kernel_memory_bytes is not None else \
            capacity.limit_memory_bytes
        self.raw_memory = capacity.memory_bytes if kernel is None else max(capacity.memory_bytes, kernel)
        if self.throttle.limit is not None:  # online stalls on memory: offline schedulers are told less too
            capacity = replace(capacity, memory_bytes=min(capacity.memory_bytes,
                                                          self.throttle.limit // MEMORY_STEP * MEMORY_STEP))
        return capacity

    def with_capacity(self, state: State, now: Optional[float] = None, epoch: Optional[float] = None) -> State:
        """``state`` with its reclaimed capacity (admission and the quota cap) brought up to date."""
        now = time.monotonic() if now is None else now
        epoch = time.time() if epoch is None else epoch
        capacity = self.estimate(state, now, epoch)
        self.publish(capacity, epoch)
        return state.with_reclaim_capacity(capacity.millicpu)

    def refresh(self, now: float, epoch: float) -> None:
        self.io_guard.on_period(online_wait(self.io_pressure))
        self.observe_kernel_work(now)
        if self.throttle.on_period(self.memory_pressure.percent, self._unthrottled()):
            log.info("online memory pressure is down: offline memory %s", "no longer throttled"
                     if self.throttle.limit is None else f"throttled at {self.throttle.limit // MIB} MiB")
        state = self.with_capacity(self.owner.state, now, epoch)
        if state != self.owner.state:
            self.owner.commit(state)

    def observe_kernel_work(self, now: float) -> None:
        """The reclaimed workloads' kernel time this period: confine those that run in the kernel (the
        next reconcile writes their cpusets)."""
        state = self.owner.state
        if state is None or not self.enforcement.harvest:
            return  # no idle harvesting: reclaimed work is off online's cpus already
        work = self.kernel_work
        # the reclaimed tree read first: where it spent next to nothing in the kernel, none of the
        # workloads in it did, and theirs are not read (a pod's cgroup is outside it: always read)
        quiet = work.quiet(now, cpu_times_ns(self.driver, f"{self.enforcement.base}/reclaimed"))
        times, unread = {}, set()
        for alloc in state.allocations:
            if alloc.qos is QoS.RECLAIMED:
                if quiet and alloc.source == LOCAL and work.read_before(alloc.name):
                    times[alloc.name] = None
                    unread.add(alloc.name)
                    continue
                paths = self.enforcement.cgroups_of(alloc)
                times[alloc.name] = cpu_times_ns(self.driver, paths[0]) if paths else None
        before = work.names()
        # with nothing lent a confined workload waits at the minimum quota (isolation.cgroups.desired): its
        # hold, not the whole release, and timed
        lent = bool(self.owner.pools().reclaimed)
        changed = work.observe(now, times, unread, lent=lent)
        work.wait(now, frozenset() if lent else work.names() & frozenset(times))
        if changed:
            now_confined = self.kernel_work.names()
            for name in sorted(now_confined - before):
                log.info("reclaimed workload %s runs in the kernel (%d millicpu): kept off online's idle cpus%s",
                         name, self.kernel_work.kernel_millicpu.get(name, 0),
                         "" if lent else " (nothing lent: it waits at the minimum quota)")
            for name in sorted(before - now_confined):
                log.info("reclaimed workload %s no longer runs in the kernel: harvests online's idle cpus again", name)

    def confined(self) -> frozenset:
        """The reclaimed workloads kept off online's idle cpus now (services.kernel_work): those that run
        in the kernel, and new ones on probation where a lent cpu can take them; with nothing lent a new
        workload is not held at the minimum quota for what it has not yet shown (it is judged on its
        first periods like any other)."""
        state = self.owner.state
        if state is None or not self.enforcement.harvest:
            return frozenset()  # no idle harvesting: reclaimed work is off online's cpus already
        reclaimed = [a.name for a in state.allocations if a.qos is QoS.RECLAIMED]
        if not self.owner.pools().reclaimed:
            return self.kernel_work.names() & frozenset(reclaimed)
        return self.kernel_work.confined_of(reclaimed)

    def publish(self, capacity: Capacity, epoch: float) -> None:
        """Make ``capacity`` current; a new generation (long-pollers woken, offline agents pushed)
        when it, or the node's lending state, changed."""
        with self.owner.changed:
            old = self.capacity
            key = lambda c: None if c is None else (c.millicpu, c.memory_bytes, c.numa)  # noqa: E731
            self.capacity = capacity
            if key(old) != key(capacity) or self._published_node != self.lending.current:
                self._published_node = self.lending.current
                self.generation += 1
                self.updated_at = epoch
                self.owner.changed.notify_all()
                if self.on_change is not None and self.owner.state is not None:
                    self.on_change()

    def limits(self) -> tuple:
        """The reclaimed parent's (cpu cap millicpu, memory max bytes, memory high bytes or None for the
        default): the kernel enforces the capacity, and the memory throttle (``memory.high``, v2).
        The cap and the max hold still while the estimate moves within ``LIMIT_BAND`` of what they
        are (a node's use wanders by a few millicpu and MiB every period, and each move was a pass over
        every cgroup: on a busy 16-cpu node with 200 workloads, 12 in 25 s); past it, either way, and
        at any change of the throttle, they follow at once."""
        limits = self._limits()
        held = self._held_limits
        if held is not None and limits[2] == held[2] and all(
                new is not None and old is not None and abs(new - old) <= max(floor, old * LIMIT_BAND)
                for new, old, floor in zip(limits[:2], held[:2], (LIMIT_FLOOR_MILLICPU, LIMIT_FLOOR_BYTES))):
            return held
        self._held_limits = limits
        return limits

    def _limits(self) -> tuple:
        """``limits`` as the estimate has them now."""
        if self.capacity is None:
            return self.owner.state.reclaim_millicpu, self.config.cgroup_options.reclaimed_memory_max, None
        # whole MiB: the kernel keeps a limit in pages, and a value it rounded would read back as drift
        top = max(self.raw_memory if self.raw_memory is not None else self.capacity.memory_bytes, 64 * MIB) // MIB * MIB
        if self.throttle.limit is None or self.driver.version == 1:
            # v1 has no memory.high, and refuses (EBUSY) a hard limit under what a group holds when its
            # pages cannot be reclaimed (anonymous memory, no swap): there the throttle is the capacity
            # offline schedulers are told, the soft limit of 0, and eviction after its grace
            return self.capacity.cap_millicpu, top, None
        return self.capacity.cap_millicpu, top, min(self.throttle.limit, int(top * RECLAIMED_HIGH_SHARE) // MIB * MIB)

    def _unthrottled(self) -> Optional[int]:
        """What the throttled limit grows back to: the default memory.high."""
        if self.raw_memory is None:
            return None
        return int(max(self.raw_memory, 64 * MIB) * RECLAIMED_HIGH_SHARE) // MIB * MIB

    def capacity_numbers(self) -> Dict[str, Any]:
        cap = self.capacity or Capacity(0, 0, "requests")
        return {"millicpu": cap.millicpu, "memory_bytes": cap.memory_bytes, "source": cap.source,
                "numa": [{"id": n, "millicpu": c, "memory_bytes": m} for n, c, m in cap.numa],
                "valid_seconds": max(30, int(math.ceil(3 * self.config.period)))}

"""Harvest: what online leaves idle, measured, sized and published.

Every period: sample usage (the pools' aggregates; each workload's every
``usage_period``); online = everything but the reclaimed and dedicated trees,
Tidal's helpers, the cgroups declared offline (``--offline-cgroup``: an
offline system's own daemons and containers where they live outside Tidal's
tree) and the cgroups of reclaimed and dedicated pods (the kubelet's, in
Kubernetes mode: counted as online, a reclaimed pod's own use would shrink
the capacity it runs on); protect online's memory (``services.protection``);
resize the reclaim pool (``ReclaimSizer``); estimate the reclaimed capacity
(``CapacityEstimator``; both use THE headroom rule, ``contracts.headroom``);
publish it (generation, long-pollers, the push to offline agents) when it
changes. Between periods the fast guard (``services.guard``) takes back what
online needs at once.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional

from agent.lending import OFFLINE, NodeLending
from agent.qrm.policy import State, _layout
from agent.reporter.capacity import MEMORY_STEP, MIB, Capacity, CapacityEstimator, HourlyHistory
from agent.reporter.headroom import ReclaimSizer
from agent.reporter.pressure import PressureMeter
from agent.reporter.task_cpus import TaskCpuAttribution, scale_to
from agent.reporter.usage import UsageSampler
from agent.isolation.cgroups.desired import HELPERS, RECLAIMED_HIGH_SHARE
from agent.isolation.cgroups.driver import cpu_times_ns, procs_in_tree
from agent.qrm.model import LOCAL, QoS
from agent.services.enforcement import Enforcement
from agent.services.cpu_pressure import CpuPressureLoop
from agent.services.io_guard import IoGuard
from agent.services.kernel_work import KernelWork
from agent.services.memory_throttle import MemoryThrottle
from agent.services.guard import FastGuard, online_wait
from agent.services.owner import StateOwner
from agent.services.protection import ONLINE_TREES, MemoryProtection

log = logging.getLogger("tidal.agent")
TREES = ("reclaimed", "dedicated", "shared", "system", HELPERS)
NOT_ONLINE = ("reclaimed", "dedicated", HELPERS)  # the trees whose use is not online demand


def _percpu(text: Optional[str]) -> Optional[List[int]]:
    """v1 ``cpuacct.usage_percpu``: ns per cpu, or ``None``."""
    try:
        return [int(v) for v in text.split()] if text else None
    except ValueError:
        return None


class Harvest:
    def __init__(self, owner: StateOwner, enforcement: Enforcement, lending: NodeLending, config,
                 counters: Dict[str, int], history_path: str) -> None:
        self.owner = owner
        self.enforcement = enforcement
        self.driver = enforcement.driver
        self.lending = lending
        self.config = config
        self.counters = counters
        self.sizer = ReclaimSizer()
        self.estimator = CapacityEstimator(history=HourlyHistory(history_path))
        self.sampler: Optional[UsageSampler] = None
        self.usage: Dict[str, int] = {}
        self.cpu_usage: Dict[int, int] = {}
        self.online_millicpu = 0
        self.online_bytes = 0
        self.offline_bytes = 0  # what offline work holds: the reclaimed tree, declared offline cgroups, reclaimed pods
        self.available_bytes: Optional[int] = None  # the node's MemAvailable (live hosts only)
        self.protection = MemoryProtection(owner, enforcement)  # memory.low of online's cgroups
        self.capacity: Optional[Capacity] = None
        self.generation = 0
        self.updated_at = time.time()
        self.on_change: Optional[Callable[[], None]] = None  # the push to offline agents
        self._published_node = None
        self._saved_hour = None
        self._percpu_last = None
        base = enforcement.base
        self.aggregates = [f"{base}/{tree}" for tree in TREES]
        # the pool aggregates are read every period: through files kept open (see usage_reader)
        self._aggregate_readers = {p: self.driver.usage_reader(p) for p in self.aggregates}
        self._percpu_readers = [self.driver.percpu_reader(f"{base}/{tree}") for tree in NOT_ONLINE]
        # cgroups outside Tidal's tree whose use is offline, read from the hierarchies' roots
        self.offline_cgroups = tuple(p.strip("/") for p in getattr(config, "offline_cgroups", ()) or ())
        self.offline_usage: Dict[str, Optional[int]] = {}
        self._offline_last: tuple = (None, {})  # (time, counters) of the previous sample
        rooted = self.driver.root_view() if self.offline_cgroups else None
        self._rooted = rooted
        self._offline_readers = {p: rooted.usage_reader(p) for p in self.offline_cgroups}
        self._offline_percpu = [rooted.percpu_reader(p) for p in self.offline_cgroups]
        # v2 has no per-cpu counter: per-thread run time, where the driver can list a tree's processes
        self._tasks = None
        if self.driver.version == 2 and getattr(self.driver, "fs", None) is not None and self.driver.fs.is_live:
            self._tasks = TaskCpuAttribution(lambda: [
                *(pid for tree in NOT_ONLINE for pid in procs_in_tree(self.driver, f"{base}/{tree}")),
                *(pid for path in self.offline_cgroups if self._rooted.present(path)
                  for pid in procs_in_tree(self._rooted, path)),
                *(pid for path in self.offline_pods() if self.driver.present(path)
                  for pid in procs_in_tree(self.driver, path))])

        # online's memory stall share (PSI), every period: a cause of eviction (services.eviction), and the
        # throttle's way back; the fast guard has its own meter, for the throttle's cut
        self.memory_pressure = PressureMeter(self.driver.pressure, self.online_cgroups, "memory")
        self.throttle = MemoryThrottle(getattr(config, "memory_pressure_threshold", 0.0))
        # online's cpu stall share: the fast guard takes lent cpus back on it, the period holds lending
        # (services.cpu_pressure)
        self.cpu_pressure = PressureMeter(self.driver.pressure, self.online_cgroups, "cpu")
        self.cpu_loop = CpuPressureLoop(getattr(config, "cpu_pressure_threshold", 0.0))
        # online's io stall share: the fast guard limits offline's block io on it, the period lifts the
        # limits slowly (services.io_guard); on v1, or with no io controller, it is shown only
        self.io_pressure = PressureMeter(self.driver.pressure, self.online_cgroups, "io")
        # reclaimed workloads that run in the kernel: off online's idle cpus (services.kernel_work)
        self.kernel_work = KernelWork()
        self.io_guard = IoGuard(self.driver, self.io_cgroups, getattr(config, "io_pressure_threshold", 0.0),
                                stopping=lambda: self.guard.stopping())
        self.raw_memory: Optional[int] = None  # the reclaimed memory capacity before the throttle
        self._online_key: Optional[tuple] = None  # (state, placements, paths) of online_cgroups()
        self._pods_key: Optional[tuple] = None  # (state, placements, pods) of offline_pods()
        self.guard = FastGuard(self)  # between periods: online gets cpus and memory back at once

    def online_cgroups(self) -> List[str]:
        """Where online work lives: Tidal's online trees and the cgroups of online pods (worked out again
        only when the state or the placements changed: the fast guard asks every interval)."""
        state, placements = self.owner.state, self.owner.placements
        key = self._online_key
        if key is not None and key[0] is state and key[1] == placements:
            return key[2]
        base = self.enforcement.base
        paths = [f"{base}/{tree}" for tree in ONLINE_TREES]
        for alloc in state.allocations if state is not None else ():
            if alloc.qos is not QoS.RECLAIMED and alloc.source != LOCAL:
                paths += self.enforcement.cgroups_of(alloc)[:1]
        self._online_key = (state, dict(placements), paths)
        return paths

    def offline_pods(self) -> Dict[str, bool]:
        """The cgroups of workloads placed outside Tidal's tree (pods) whose use is not online demand,
        each with whether its memory is offline's: reclaimed pods (cpu and memory) and dedicated pods
        (cpu only, as Tidal's dedicated tree: their cpus are never lent, and their memory is online's).
        Read every period, as the trees are (worked out again only when the state or placements changed)."""
        state, placements = self.owner.state, self.owner.placements
        key = self._pods_key
        if key is not None and key[0] is state and key[1] == placements:
            return key[2]
        pods: Dict[str, bool] = {}
        for alloc in state.allocations if state is not None else ():
            paths = placements.get(alloc.name) if alloc.source != LOCAL else None
            if paths and alloc.qos in (QoS.RECLAIMED, QoS.DEDICATED):
                pods[paths[0]] = alloc.qos is QoS.RECLAIMED
        self._pods_key = (state, dict(placements), pods)
        return pods

    def io_cgroups(self) -> List[str]:
        """Where offline work's block io is counted and limited: the reclaimed tree and reclaimed pods."""
        pods = [p for p, reclaimed in self.offline_pods().items() if reclaimed and self.driver.present(p)]
        return [f"{self.enforcement.base}/reclaimed", *pods]

    def start(self) -> Optional[str]:
        """Ready to sample; a warning line when the usage history was unusable."""
        self.sampler = UsageSampler(self._cpu_usage_ns, cpu_ids=self.owner.topology.online_cpus())
        return self.estimator.history.load()

    def _cpu_usage_ns(self, path: str) -> Optional[int]:
        reader = self._aggregate_readers.get(path)
        return reader() if reader is not None else self.driver.cpu_usage_ns(path)

    # ---- every period ------------------------------------------------------------------------

    def sample(self, now: float, epoch: float, workload_paths) -> bool:
        """One usage sample (False when there is none yet: the first period)."""
        for meter in (self.memory_pressure, self.cpu_pressure, self.io_pressure):
            meter.sample(now)
        offline_before = self._offline_counters()
        sample = self.sampler.sample(now, [*self.aggregates, *workload_paths])
        if sample is None:
            self._offline_last = (now, offline_before)
            return False
        self._offline_rates(now, offline_before)
        self.usage.update(sample.per_cgroup_millicpu)
        self.cpu_usage = sample.per_cpu_millicpu
        self._observe(sample, now, epoch)
        return True

    def forget(self, live_paths) -> None:
        live = set(self.aggregates) | set(live_paths)
        self.sampler.forget(live)
        self.usage = {p: v for p, v in self.usage.items() if p in live}

    def _offline_counters(self) -> Dict[str, Optional[int]]:
        counters = {path: read() for path, read in self._offline_readers.items()}
        # a pod's cgroup comes and goes: opened each time (a reader kept open would hold its file past it)
        counters.update({path: self.driver.cpu_usage_ns(path) for path in self.offline_pods()})
        return counters

    def _offline_rates(self, now: float, counters: Dict[str, Optional[int]]) -> None:
        """Each offline cgroup's (declared, or an offline pod's) millicpu since the last sample (None
        while it is missing); a pod that ended is dropped."""
        last_time, last = self._offline_last
        self._offline_last = (now, counters)
        usage: Dict[str, Optional[int]] = {}
        for path, value in counters.items():
            before = last.get(path)
            if value is None or before is None or last_time is None or now <= last_time:
                usage[path] = None if value is None else self.offline_usage.get(path, 0)
                continue
            usage[path] = max(0, round((value - before) / 1e6 / (now - last_time)))
        self.offline_usage = usage

    def _observe(self, sample, now: float, epoch: float) -> None:
        base = self.enforcement.base
        not_online = sum(sample.per_cgroup_millicpu.get(f"{base}/{tree}", 0) for tree in NOT_ONLINE)
        declared = sum(v or 0 for v in self.offline_usage.values())
        self.online_millicpu = max(0, sample.total_millicpu - not_online - declared)
        view = self.memory_view()
        used = view[0] - view[1] if view is not None else 0
        trees = self.protection.protect()
        offline_bytes = self.driver.memory_usage_bytes(f"{base}/reclaimed") or 0
        offline_bytes += sum(self._rooted.memory_usage_bytes(p) or 0 for p in self.offline_cgroups)
        offline_bytes += sum(self.driver.memory_usage_bytes(p) or 0 for p, memory in self.offline_pods().items()
                             if memory)
        # online's use: the node's in use (its inactive page cache counted free, as MemAvailable counts
        # it) less offline's, and never less than what Tidal's online trees hold with all their page
        # cache: a service's mapped files sit on the inactive list between touches, and a capacity that
        # counted them free would let offline push the service's working set out (bench memory-isolation
        # measured 63 major faults and a 145 ms p99 on v1 before this)
        self.offline_bytes = offline_bytes
        self.online_bytes = max(0, used - offline_bytes, trees)
        self.estimator.observe(now, epoch, self.online_millicpu, self.online_bytes, self._online_per_node(sample, now))
        hour = self.estimator.history.key(epoch)
        if self._saved_hour != hour or int(now) % 60 == 0:
            self._saved_hour = hour
            try:
                self.estimator.history.save()
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop the loop
                log.warning("cannot save usage history: %s", exc)

    def read_available(self) -> Optional[int]:
        """The node's available memory (MemAvailable) now, kept for the status; ``None`` off a live host
        (a fixture's root or recorded cgroups: the machine's memory is not the node's)."""
        if self.config.root != "/" or self.config.cgroups_in_memory:
            return None
        view = self.memory_view()
        self.available_bytes = None if view is None else view[1]
        return self.available_bytes

    def memory_view(self) -> Optional[tuple]:
        """(total, available) bytes of the memory Tidal manages: the machine's (``MemTotal``,
        ``MemAvailable``), or where a limit on Tidal's parent cgroup is tighter (a slice with
        ``MemoryMax=``, a container), that limit and what is left under it (``driver.memory_ceiling``).
        ``None`` when neither can be read."""
        try:
            import psutil

            memory = psutil.virtual_memory()
            total, available = memory.total, memory.available
        except Exception:  # noqa: BLE001
            return None
        ceiling = self.driver.memory_ceiling()
        if ceiling is not None:
            total, available = min(total, ceiling[0]), min(available, ceiling[1])
        return total, available

    def _online_per_node(self, sample, now: float) -> Optional[Dict[int, int]]:
        """Online millicpu on each NUMA node's cpus: per-cpu busy less what the reclaimed and
        dedicated trees took on each cpu; ``None`` when that is not known (yet)."""
        offline = self._offline_per_cpu(sample, now)
        if offline is None or not sample.per_cpu_millicpu:
            return None
        topo = self.owner.topology
        if isinstance(offline, (int, float)):  # one NUMA node: the trees' total is enough
            return {n.id: max(0, round(sum(sample.per_cpu_millicpu.values()) - offline)) for n in topo.numa_nodes}
        per_node: Dict[int, int] = {}
        for cpu, busy in sample.per_cpu_millicpu.items():
            try:
                numa = topo.cpu(cpu).numa
            except KeyError:
                continue
            if numa is not None:
                per_node[numa] = per_node.get(numa, 0) + max(0, round(busy - offline.get(cpu, 0.0)))
        return per_node

    def _offline_per_cpu(self, sample, now: float):
        """Millicpu the reclaimed and dedicated trees took on each cpu since the last period: v1's
        ``cpuacct.usage_percpu``; on v2 (no per-cpu counter) each thread's run time charged to the cpu
        it last ran on, scaled to the trees' ``cpu.stat`` (see ``reporter.task_cpus``). On v2 with one
        NUMA node, the trees' total alone (a number, not a map): that node's figure needs no per-cpu split,
        and the threads' walk is the largest part of a v2 period with many offline cgroups."""
        other = [read() for read in self._percpu_readers]
        if any(v is None for v in other):
            if self._tasks is None:
                return None
            base = self.enforcement.base
            total = sum(sample.per_cgroup_millicpu.get(f"{base}/{tree}", 0) for tree in NOT_ONLINE)
            total += sum(v or 0 for v in self.offline_usage.values())
            if len(self.owner.topology.numa_nodes) <= 1:
                return total
            if not total:
                # nothing offline ran (under half a millicpu): nothing to charge, and no walk: a thread that
                # did not run kept its run time, so the last walk's figures stay the base to charge from
                return {}
            charged = self._tasks.sample()
            if not charged:
                return None  # the first sample, or threads too short-lived to be seen
            return scale_to(charged, total)
        # each counter's own delta: a declared offline cgroup that appears or goes counts from its next sample
        counters = {i: v for i, v in enumerate(other)}
        counters.update({("offline", i): v for i, v in enumerate(read() for read in self._offline_percpu)
                         if v is not None and len(v) == len(other[0])})
        for path in self.offline_pods():
            values = _percpu(self.driver.read("cpuacct", path, "cpuacct.usage_percpu"))
            if values is not None and len(values) == len(other[0]):
                counters[("pod", path)] = values
        last = self._percpu_last
        self._percpu_last = (now, counters)
        if last is None or now <= last[0]:
            return None
        elapsed = now - last[0]
        width = len(other[0])
        out = [0.0] * width
        for key, values in counters.items():
            before = last[1].get(key)
            if before is None or len(before) != width:
                if not isinstance(key, tuple):
                    return None  # one of Tidal's own trees without a previous reading: not known yet
                continue
            for cpu in range(width):
                out[cpu] += values[cpu] - before[cpu]
        return {cpu: out[cpu] / 1e9 / elapsed * 1000 for cpu in range(width)}

    def resize(self) -> None:
        """The reclaim pool's size from online's demand (the sizer); lent: all but what shared needs."""
        owner = self.owner
        lay = _layout(owner.topology, owner.state)
        if self.lending.current.state == OFFLINE:
            shared_target = lay.shared_need  # lent: everything not needed goes to offline
        else:
            shared_target = self.sizer.update(self.online_millicpu, lay.shared_need, len(lay.free),
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
            view = self.memory_view()
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
        requests = (state.totals.shared_millicpu, self.online_bytes)
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
        times = {}
        for alloc in state.allocations:
            if alloc.qos is QoS.RECLAIMED:
                paths = self.enforcement.cgroups_of(alloc)
                times[alloc.name] = cpu_times_ns(self.driver, paths[0]) if paths else None
        before = self.kernel_work.names()
        if self.kernel_work.observe(now, times):
            now_confined = self.kernel_work.names()
            for name in sorted(now_confined - before):
                log.info("reclaimed workload %s runs in the kernel (%d millicpu): kept off online's idle cpus",
                         name, self.kernel_work.kernel_millicpu.get(name, 0))
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
        default): the kernel enforces the capacity, and the memory throttle (``memory.high``, v2)."""
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

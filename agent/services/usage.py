"""Usage: what work uses on the node, every period.

The pools' aggregates are sampled every period and each workload's every ``usage_period``
(``reporter.usage``). Online is everything but the reclaimed and dedicated trees, Tidal's helpers, the
cgroups declared offline (``--offline-cgroup``: an offline system's own daemons and containers where they
live outside Tidal's tree) and the cgroups of reclaimed and dedicated pods (the kubelet's, in Kubernetes
mode: counted as online, a reclaimed pod's own use would shrink the capacity it runs on). Its memory is
the node's in use less offline's, never less than what Tidal's online trees hold. Per NUMA node, online's
cpu is each cpu's busy less what offline took there (v1's per-cpu counters; on v2 each thread's run time,
``reporter.task_cpus``).

What is done with the figures (the reclaim pool's size, the capacity, its publication) is
``services.harvest``'s; this module only measures.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from agent.isolation.cgroups.desired import HELPERS
from agent.isolation.cgroups.driver import procs_in_tree
from agent.qrm.model import LOCAL, QoS
from agent.reporter.task_cpus import TaskCpuAttribution, scale_to
from agent.reporter.usage import UsageSampler
from agent.services.enforcement import Enforcement
from agent.services.owner import StateOwner
from agent.services.protection import ONLINE_TREES

TREES = ("reclaimed", "dedicated", "shared", "system", HELPERS)
NOT_ONLINE = ("reclaimed", "dedicated", HELPERS)  # the trees whose use is not online demand


def _percpu(text: Optional[str]) -> Optional[List[int]]:
    """v1 ``cpuacct.usage_percpu``: ns per cpu, or ``None``."""
    try:
        return [int(v) for v in text.split()] if text else None
    except ValueError:
        return None


class Usage:
    """The node's use by online and offline work (see the module docstring)."""

    def __init__(self, owner: StateOwner, enforcement: Enforcement, config) -> None:
        self.owner = owner
        self.enforcement = enforcement
        self.driver = enforcement.driver
        self.config = config
        self.sampler: Optional[UsageSampler] = None
        self.by_cgroup: Dict[str, int] = {}  # millicpu by cgroup path: the pools' aggregates and the workloads'
        self.by_cpu: Dict[int, int] = {}  # millicpu by cpu
        self.online_millicpu = 0
        self.online_bytes = 0
        self.offline_bytes = 0  # what offline work holds: the reclaimed tree, declared offline cgroups, reclaimed pods
        self.available_bytes: Optional[int] = None  # the node's MemAvailable (live hosts only)
        self._percpu_last = None
        base = enforcement.base
        self.aggregates = [f"{base}/{tree}" for tree in TREES]
        # the pool aggregates are read every period: through files kept open (see usage_reader)
        self._aggregate_readers = {p: self.driver.usage_reader(p) for p in self.aggregates}
        self._workload_readers: Dict[str, Callable[[], Optional[int]]] = {}  # kept open until forgotten
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
        self._online_key: Optional[tuple] = None  # (state, placements, paths) of online_cgroups()
        self._view: Optional[tuple] = None  # this period's memory_view()
        self._pods_key: Optional[tuple] = None  # (state, placements, pods) of offline_pods()

    def online_cgroups(self) -> List[str]:
        """Where online work lives: Tidal's online trees, then the own cgroup of each online pod (worked
        out again only when the state or the placements changed: the fast guard asks every interval).
        The pressure meters read them, and the memory protection measures them."""
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

    def start(self) -> None:
        self.sampler = UsageSampler(self._cpu_usage_ns, cpu_ids=self.owner.topology.online_cpus())

    def _cpu_usage_ns(self, path: str) -> Optional[int]:
        """The pools' aggregates and the workloads' cgroups, each through a file kept open (a workload's
        closed by ``forget`` once it is gone: every watch period)."""
        reader = self._aggregate_readers.get(path) or self._workload_readers.get(path)
        if reader is None:
            reader = self._workload_readers[path] = self.driver.usage_reader(path)
        return reader()

    def sample(self, now: float, workload_paths):
        """One usage sample, the cpu figures brought up to date from it (the memory figures: ``memory``);
        ``None`` when there is none yet (the first period)."""
        self._view = None  # a new period: the node's memory is read again
        offline_before = self._offline_counters()
        sample = self.sampler.sample(now, [*self.aggregates, *workload_paths])
        if sample is None:
            self._offline_last = (now, offline_before)
            return None
        self._offline_rates(now, offline_before)
        self.by_cgroup.update(sample.per_cgroup_millicpu)
        self.by_cpu = sample.per_cpu_millicpu
        base = self.enforcement.base
        not_online = sum(sample.per_cgroup_millicpu.get(f"{base}/{tree}", 0) for tree in NOT_ONLINE)
        declared = sum(v or 0 for v in self.offline_usage.values())
        self.online_millicpu = max(0, sample.total_millicpu - not_online - declared)
        return sample

    def forget(self, live_paths) -> None:
        live = set(self.aggregates) | set(live_paths)
        self.sampler.forget(live)
        for path in [p for p in self._workload_readers if p not in live]:
            close = getattr(self._workload_readers.pop(path), "close", None)
            if close is not None:
                close()
        self.by_cgroup = {p: v for p, v in self.by_cgroup.items() if p in live}

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

    def memory(self, trees: int) -> None:
        """Online's and offline's memory now; ``trees``: what Tidal's online trees hold (their memory
        protection's figure, ``services.protection``)."""
        base = self.enforcement.base
        view = self.memory_view()
        used = view[0] - view[1] if view is not None else 0
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
        ``None`` when neither can be read. Read once a period (``sample`` starts a new one) for all its
        callers there (the usage figures, the eviction check, the capacity), not once by each; a caller
        between periods (the status) has the last period's."""
        if self._view is not None:
            return self._view
        try:
            import psutil

            memory = psutil.virtual_memory()
            total, available = memory.total, memory.available
        except Exception:  # noqa: BLE001
            return None
        ceiling = self.driver.memory_ceiling()
        if ceiling is not None:
            total, available = min(total, ceiling[0]), min(available, ceiling[1])
        self._view = (total, available)
        return self._view

    def online_per_node(self, sample, now: float) -> Optional[Dict[int, int]]:
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

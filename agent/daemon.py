"""The node agent (``tidal agent``): state, kernel and API kept in step.

Start:
1. discover the topology; detect cgroups (v1 or v2) and build the driver;
2. load the checkpoint (corrupt: rebuild from the cgroup tree, see
   ``isolation.cgroups.recover``); adopt saved original values for revert;
3. reconcile the kernel to the state (writes only differences), so workloads
   that ran through an agent crash stay confined;
4. serve the local API (unix socket, mode 0600; optional loopback TCP).

Every period (default 1 s): sample usage; release workloads whose cgroups
have been empty (after a grace period for new ones); resize the reclaim pool
from online usage (``reporter.headroom``); reconcile (repairing drift made
by others, counted); checkpoint when the state changed.

SIGTERM/SIGINT: stop serving, keep the state and the cgroups (workloads keep
running, confined). ``--revert``: also put the kernel back as found.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional

from agent.errors import AdmissionError, Conflict, NotFound, TidalError, Unfit  # noqa: F401 - raised here
from agent.statefiles import write_json
from agent.isolation.cgroups.desired import CgroupOptions, desired_tree, harvests
from agent.isolation.cgroups.detect import CgroupError, detect
from agent.isolation.cgroups.driver import CgroupDriver, KernelCgroups
from agent.isolation.cgroups.layout import workload_path
from agent.isolation.cgroups.reconcile import Reconciler, ReconcileReport
from agent.isolation.cgroups.recover import recover_state
from agent.qrm.assignment import assignment, reclaimed_cpus
from agent.qrm.model import LOCAL, SOURCES, Allocation, QoS, Rejection
from agent.qrm.policy import State, _layout, allocate, pools, release
from agent.qrm.requests import parse_request
from agent.qrm.state import CheckpointStore
from agent.lending import OFFLINE, TO_OFFLINE, TO_ONLINE, NodeLending, TransitionError, parse_notice
from agent.qrm.eviction import choose_victims
from agent.reporter.capacity import MIB, Capacity, CapacityEstimator, HourlyHistory
from agent.reporter.headroom import ReclaimSizer
from agent.reporter.usage import UsageSampler
from agent.topology import HostFS, Topology, discover
from agent.topology.parse import format_cpulist

log = logging.getLogger("tidal.agent")

DEFAULT_SOCKET = "/run/tidal/tidal.sock"
DEFAULT_STATE_DIR = "/var/lib/tidal"


@dataclass(frozen=True)
class AgentConfig:
    root: str = "/"
    socket_path: str = DEFAULT_SOCKET
    state_dir: str = DEFAULT_STATE_DIR
    tcp_port: Optional[int] = None  # loopback only
    reserved_cpus: Optional[tuple] = None  # None: the first physical core
    period: float = 1.0
    cgroup_base: str = "tidal"
    cgroup_parent: str = "/"  # or "self": under the agent's own cgroup in each hierarchy
    empty_grace: float = 30.0  # a new workload's cgroup may stay empty this long before release
    resize: bool = True  # resize the reclaim pool from usage
    revert_on_exit: bool = False
    record_cgroups: bool = False  # keep cgroup writes in memory (dry runs, end-to-end tests off the host)
    confine_self: bool = False  # move the agent itself into <base>/system (the reserved pool)
    eviction_grace: float = 10.0  # over-committed reclaimed work is throttled this long before eviction
    online_policy: str = "wait"  # lending: "wait" for online workloads to finish, or "evict" them at the notice end
    hooks: Dict[str, List[str]] = field(default_factory=dict)  # node state -> argv run on entering it
    memory_reserved_bytes: Optional[int] = None  # kept from offline agents (default: 5% of memory, at least 1 GiB)
    push_command: Optional[List[str]] = None  # argv run with the capacity on every change
    push_url: Optional[str] = None  # POSTed the capacity (YARN shape) on every change
    push_format: str = "yarn"
    guard_interval: float = 0.05  # the fast guard's sampling interval (0: off)
    api_poll_interval: float = 0.5  # how often idle API threads wake (shutdown latency vs idle cpu)
    drift_check_period: float = 30.0  # seconds between full reads of the cgroup tree (drift repair)
    watch_period: float = 10.0  # seconds between checks for emptied workloads
    usage_period: float = 10.0  # seconds between per-workload usage samples (pool aggregates: every period)
    cgroup_options: CgroupOptions = field(default_factory=CgroupOptions)
    net: Optional[Any] = None  # isolation.net.policy.NetConfig: shape traffic of these NICs
    socket_group: Optional[int] = None  # a gid whose members may use the socket with a user's authority
    tcp_token: Optional[str] = None  # bearer token that lets TCP clients write (agent.authority)


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int((epoch % 1) * 1000):03d}Z"


class Agent:
    def __init__(self, config: AgentConfig, echo: Callable[[str], None] = print,
                 driver: Optional[CgroupDriver] = None, topology: Optional[Topology] = None) -> None:
        self.config = config
        self.echo = echo
        self.topology = topology
        self.driver = driver
        self.lock = threading.RLock()
        self.state: Optional[State] = None
        self.store = CheckpointStore(os.path.join(config.state_dir, "checkpoint.json"))
        self.reconciler: Optional[Reconciler] = None
        self.sizer = ReclaimSizer()
        self.sampler: Optional[UsageSampler] = None
        self.usage: Dict[str, int] = {}
        self.cpu_usage: Dict[int, int] = {}
        self.seen_procs: Dict[str, bool] = {}
        self.created_at: Dict[str, float] = {}
        self.counters: Dict[str, int] = {"drift_repairs": 0, "reconciles": 0, "reconcile_failures": 0,
                                         "released_empty": 0, "fast_shrinks": 0}
        self.estimator = CapacityEstimator(history=HourlyHistory(os.path.join(config.state_dir, "history.json")))
        self.lending = NodeLending(os.path.join(config.state_dir, "node.json"), config.hooks)
        self.capacity: Optional[Capacity] = None
        self.generation = 0
        self.updated_at = time.time()
        self.changed = threading.Condition(self.lock)
        self.evictions: List[Dict[str, Any]] = []
        self.evictions_by_tier: Dict[str, int] = {"low": 0, "min": 0, "high": 0}
        self.overcommit_since: Optional[float] = None
        self.online_millicpu = 0
        self.online_bytes = 0
        self.kill_signal = signal.SIGKILL
        self.pusher = None
        self.net = None  # NetShaper when config.net is set
        self.on_started: Optional[Callable[[], None]] = None  # e.g. the Kubernetes pod source
        # where the processes of workloads from other sources live (a pod's cgroups, parent first);
        # a local workload's live in its leaf of Tidal's tree and have no entry here
        self.placements: Dict[str, tuple] = {}
        if config.push_command or config.push_url:
            from agent.reporter.push import Pusher

            self.pusher = Pusher(config.push_command, config.push_url, config.push_format)
        self.last_report: Optional[ReconcileReport] = None
        self.last_reconcile_ms = 0.0
        self._stop = threading.Event()
        self._last_verify = -1e18
        self._reconciled_key = None
        self._paths = (None, {}, {})
        self._pools_memo = (None, None)
        self._last_watch = -1e18
        self._last_usage = -1e18
        self._server = None

    # ---- start -------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        if self.topology is None:
            self.topology = discover(HostFS(cfg.root))
        if self.driver is None and cfg.record_cgroups:
            from agent.isolation.cgroups.driver import RecordingCgroups

            self.driver = RecordingCgroups(version=1)
        if self.driver is None:
            mounts = detect(HostFS(cfg.root))
            self.driver = KernelCgroups(mounts, HostFS(cfg.root), parent=cfg.cgroup_parent)
        self.reconciler = Reconciler(self.driver, cfg.cgroup_base)
        base = cfg.cgroup_base
        # the pool aggregates are read every period: through files kept open (see usage_reader)
        self._aggregate_readers = {p: self.driver.usage_reader(p) for p in
                                   (f"{base}/reclaimed", f"{base}/dedicated", f"{base}/shared", f"{base}/system")}
        self.sampler = UsageSampler(self._cpu_usage_ns, cpu_ids=self.topology.online_cpus())
        self._percpu_readers = [self.driver.percpu_reader(f"{base}/{tree}") for tree in ("reclaimed", "dedicated")]
        os.makedirs(cfg.state_dir, exist_ok=True)
        self.estimator.history.load()
        self.lending.load()
        result = self.store.load(self.topology, reserved=cfg.reserved_cpus,
                                 recover=lambda topo: recover_state(self.driver, cfg.cgroup_base, topo,
                                                                    cfg.reserved_cpus))
        for warning in result.warnings:
            self.echo(f"tidal agent: warning: {warning}")
        state = result.state
        if cfg.reserved_cpus is not None and tuple(cfg.reserved_cpus) != state.reserved:
            from agent.qrm.policy import initial_state

            check = initial_state(self.topology, cfg.reserved_cpus)
            clash = set(check.reserved) & set(self._pools(state).dedicated)
            if clash:
                raise AdmissionError(f"reserved cpus {format_cpulist(clash)} are held by dedicated workloads")
            state = replace(state, reserved=check.reserved)
        self.state = self._with_capacity(state)
        self._load_originals()
        now = time.monotonic()
        for alloc in self.state.allocations:
            self.created_at[alloc.name] = now
            self.seen_procs[alloc.name] = False
        report = self.reconcile()
        self.store.save(self.state, self.topology)
        if cfg.net is not None:
            self._start_net()
        if cfg.confine_self and not cfg.record_cgroups and self._pools().reserved:
            try:
                self.driver.move(f"{cfg.cgroup_base}/system", os.getpid())
            except CgroupError as exc:
                self.echo(f"tidal agent: warning: cannot move the agent into the system pool: {exc}")
        topo = self.topology
        self.echo(
            f"tidal agent: {len(topo.socket_ids())} sockets, {len(topo.numa_nodes)} NUMA nodes, "
            f"{len(topo.core_ids())} cores, {len(topo.online_cpus())} cpus; cgroup v{self.driver.version}; "
            f"{len(self.state.allocations)} workloads ({result.source}); "
            f"{len(report.written)} cgroup writes, {len(report.failed)} failures")
        for warning in topo.warnings:
            self.echo(f"tidal agent: warning: {warning}")

    def _start_net(self) -> None:
        """Traffic shaping (isolation.net) after the cgroups exist: the classifier matches the
        reclaimed tree's cgroup2 directory, which nft resolves when the rule is loaded."""
        from agent.isolation.net.shaper import NetShaper

        base, driver = self.config.cgroup_base, self.driver
        membership = getattr(driver, "membership_dir", lambda path: None)
        mounts = getattr(driver, "mounts", None)
        self.net = NetShaper(self.config.net, offline_dir=membership(f"{base}/reclaimed"),
                             system_dir=membership(f"{base}/system"),
                             cgroup2_root=mounts.unified if mounts is not None else None,
                             echo=lambda line: self.echo(f"tidal agent: {line}"))
        self.net.setup()

    def net_status(self) -> Dict[str, Any]:
        return self.net.status() if self.net is not None else {"enabled": False}

    def _pools(self, state: Optional[State] = None):
        """``pools`` of ``state`` (default: the current one), computed once per state:
        the loop, the API and the guard all ask for it, and it changes only with the state."""
        state = self.state if state is None else state
        if self._pools_memo[0] is not state:
            self._pools_memo = (state, pools(self.topology, state))
        return self._pools_memo[1]

    def _cpu_usage_ns(self, path: str) -> Optional[int]:
        reader = self._aggregate_readers.get(path)
        return reader() if reader is not None else self.driver.cpu_usage_ns(path)

    def _originals_path(self) -> str:
        return os.path.join(self.config.state_dir, "originals.json")

    def _load_originals(self) -> None:
        try:
            with open(self._originals_path()) as handle:
                self.reconciler.adopt(json.load(handle))
        except (OSError, ValueError):
            pass

    def _save_originals(self) -> None:
        data = self.reconciler.export()
        if data["originals"]:
            write_json(self._originals_path(), data)

    # ---- the state ---------------------------------------------------------

    def reconcile(self, verify: Optional[bool] = None) -> ReconcileReport:
        """Apply the state to the kernel. ``verify``: read the whole tree back and
        repair drift (default: when ``drift_check_period`` has passed)."""
        with self.lock:
            start = time.perf_counter()
            if verify is None:
                verify = start - self._last_verify >= self.config.drift_check_period
            if verify:
                self._last_verify = start
            # the reclaimed parent's cpu and memory limits are the current capacity
            cap = self.capacity.cap_millicpu if self.capacity is not None else self.state.reclaim_millicpu
            memory = (max(self.capacity.memory_bytes, 64 * MIB) if self.capacity is not None
                      else self.config.cgroup_options.reclaimed_memory_max)
            options = replace(self.config.cgroup_options, base=self.config.cgroup_base,
                              reclaimed_cap_millicpu=cap, reclaimed_memory_max=memory)
            # the state object itself, compared by identity (an id() could be reused once freed)
            last = self._reconciled_key
            unchanged = (last is not None and last[0] is self.state and last[1] == options
                         and last[2] == self.placements and not self.placements)
            if not verify and unchanged and self.last_report is not None:
                return ReconcileReport()  # nothing changed since the last pass: no work at all
            self._reconciled_key = (self.state, options, dict(self.placements))
            pool = self._pools()
            specs = desired_tree(self.topology, self.state, pool, options, self.driver.features, self.placements)
            report = self.reconciler.apply(specs, verify=verify)
            self.last_reconcile_ms = (time.perf_counter() - start) * 1000
            self.counters["reconciles"] += 1
            self.counters["drift_repairs"] += len(report.repaired)
            self.counters["reconcile_failures"] += len(report.failed)
            for path, file, was, now in report.repaired:
                log.warning("repaired %s/%s: found %r, wrote %r", path, file, was, now)
            for path, file, error in report.failed:
                log.error("cgroup write failed: %s", error)
            self.last_report = report
            if self.reconciler.originals:
                self._save_originals()
            return report

    def _commit(self, state: State) -> None:
        self.store.save(state, self.topology)
        self.state = state

    def admit(self, doc: Any, source: str = LOCAL, owner: Optional[int] = None) -> Dict[str, Any]:
        """Admit a request from ``source`` (see ``qrm.model.SOURCES``): the source, not Tidal's
        tree, later says when the workload is gone."""
        if source not in SOURCES:
            raise ValueError(f"unknown workload source {source!r}")
        request = parse_request(doc)  # AdmissionError -> 400
        with self.lock:
            node = self.lending.current.state
            if node in (TO_OFFLINE, TO_ONLINE):
                raise Conflict(f"the node is {node}: nothing new is placed during a transition")
            if node == OFFLINE and request.qos in (QoS.DEDICATED, QoS.SHARED):
                raise Conflict("the node is lent (Offline): only reclaimed_cores and system_cores are placed")
            self.state = self._with_capacity(self.state)
            decision = allocate(self.topology, self.state, request)
            if isinstance(decision, Rejection):
                if "already in use" in decision.reason:
                    raise Conflict(decision.reason)
                raise Unfit(f"{decision.name}: {decision.reason}")
            decision = replace(decision, source=source, owner=owner)
            self._commit(self._with_capacity(self.state.with_allocation(decision)))
            self.created_at[decision.name] = time.monotonic()
            self.seen_procs[decision.name] = False
            report = self.reconcile()
            failed = [f for f in report.failed if f[0] == workload_path(self.config.cgroup_base, decision)]
            if failed:
                self._commit(self.state.without(decision.name))
                self.reconcile()
                raise CgroupError(f"{decision.name}: cgroup setup failed: {failed[0][2]}")
            return self.describe(decision)

    def release(self, name: str) -> None:
        with self.lock:
            if self.state.get(name) is None:
                raise NotFound(f"no workload named {name!r}")
            self._commit(self._with_capacity(release(self.state, name)))
            self.placements.pop(name, None)
            self.seen_procs.pop(name, None)
            self.created_at.pop(name, None)
            self.reconcile()

    def place(self, name: str, paths) -> None:
        """Say where a workload's processes live (cgroups its source's owner made, parent first,
        e.g. a pod's cgroup then its containers'); the Reconciler writes its assignment there
        from now on. Only for workloads of a source other than ``local``."""
        paths = tuple(paths)
        with self.lock:
            alloc = self.state.get(name)
            if alloc is None:
                raise NotFound(f"no workload named {name!r}")
            if alloc.source == LOCAL:
                raise Conflict(f"{name} is a local workload: its processes live in Tidal's tree")
            if self.placements.get(name) != paths:
                self.placements[name] = paths
                self.reconcile()

    def owner_of(self, name: str) -> Optional[int]:
        """The uid that admitted workload ``name`` through the socket (None: root); NotFound if none."""
        with self.lock:
            alloc = self.state.get(name)
            if alloc is None:
                raise NotFound(f"no workload named {name!r}")
            return alloc.owner

    def cgroups_of(self, alloc: Allocation) -> tuple:
        """The cgroups a workload's processes live in: its placement, else its leaf in Tidal's tree."""
        if alloc.source != LOCAL:
            return self.placements.get(alloc.name, ())
        return (workload_path(self.config.cgroup_base, alloc),)

    def attach(self, name: str, pid: Any) -> Dict[str, Any]:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise AdmissionError(f"pid must be a positive integer, got {pid!r}")
        with self.lock:
            alloc = self.state.get(name)
            if alloc is None:
                raise NotFound(f"no workload named {name!r}")
            if alloc.source != LOCAL:
                raise Conflict(f"{name} is a {alloc.source} workload: its processes are placed by its source")
            try:
                self.driver.move(workload_path(self.config.cgroup_base, alloc), pid)
            except CgroupError as exc:
                if "no such process" in str(exc):
                    raise AdmissionError(str(exc)) from None
                raise
            self.seen_procs[name] = True
            return self.describe(alloc)

    def describe(self, alloc: Allocation, pool=None) -> Dict[str, Any]:
        pool = pool or self._pools()
        given = assignment(self.topology, alloc, pool, self._harvests_shared())
        paths = self.cgroups_of(alloc)
        path = paths[0] if paths else None
        return {
            "name": alloc.name, "qos": alloc.qos.value, "millicpu": alloc.millicpu, "source": alloc.source,
            "cpus": format_cpulist(given.cpus), "mems": format_cpulist(given.mems),
            "tier": alloc.tier.value if alloc.qos is QoS.RECLAIMED else None,
            "numa_binding": alloc.numa_binding, "numa_exclusive": alloc.numa_exclusive, "gpus": list(alloc.gpus),
            "cgroup": path, "cgroups": list(paths), "cgroup_dirs": self.driver.where(path) if path else {},
            "pids": sorted({pid for p in paths for pid in self.driver.procs(p)}),
            "usage_millicpu": self.usage.get(path) if path else None,
        }

    def workloads(self) -> List[Dict[str, Any]]:
        with self.lock:
            pool = self._pools()
            return [self.describe(a, pool) for a in self.state.allocations]

    def status(self) -> Dict[str, Any]:
        with self.lock:
            pool = self._pools()
            owner: Dict[int, Dict[str, Optional[str]]] = {}
            for cpu in pool.reserved:
                owner[cpu] = {"pool": "reserved", "workload": None}
            for cpu in pool.shared:
                owner[cpu] = {"pool": "shared", "workload": None}
            for cpu in pool.reclaimed:
                owner.setdefault(cpu, {"pool": "reclaimed", "workload": None})
            for cpu in pool.idle:
                owner[cpu] = {"pool": "held-idle", "workload": None}
            for alloc in self.state.allocations:
                if alloc.qos is QoS.DEDICATED:
                    for cpu in alloc.cpus:
                        owner[cpu] = {"pool": "dedicated", "workload": alloc.name}
            cpus = [{"id": c, "numa": self.topology.cpu(c).numa, "core": self.topology.cpu(c).core,
                     **owner.get(c, {"pool": "unassigned", "workload": None}),
                     "usage_millicpu": self.cpu_usage.get(c)} for c in self.topology.online_cpus()]
            return {
                "cgroup_version": self.driver.version, "cgroup_base": self.config.cgroup_base,
                "pools": {k: format_cpulist(v) for k, v in pool.to_dict().items()},
                "reclaim_cpus_target": self.state.reclaim_cpus, "reclaimed_capacity_millicpu": self.state.reclaim_millicpu,
                "workloads": len(self.state.allocations), "cpus": cpus, "counters": dict(self.counters),
                "evictions_by_tier": dict(self.evictions_by_tier), "recent_evictions": self.evictions[-20:],
                "node_state": self.lending.current.state,
                "last_reconcile_ms": round(self.last_reconcile_ms, 3),
                "state_file": self.store.path, "socket": self.config.socket_path,
            }

    # ---- the loop ----------------------------------------------------------

    def tick(self, now: Optional[float] = None, epoch: Optional[float] = None) -> None:
        """One period of the loop (exposed for tests; the clocks may be passed in)."""
        now = time.monotonic() if now is None else now
        epoch = time.time() if epoch is None else epoch
        with self.lock:
            base = self.config.cgroup_base
            if self._paths[0] is not self.state or self._paths[2] != self.placements:
                # the cgroup each workload's usage is read from: its leaf, or the first of its placement
                self._paths = (self.state, {a.name: self.cgroups_of(a)[0] for a in self.state.allocations
                                            if self.cgroups_of(a)}, dict(self.placements))
            paths = self._paths[1]
            watch = now - self._last_watch >= self.config.watch_period
            per_workload = now - self._last_usage >= self.config.usage_period
            if per_workload:
                self._last_usage = now
            aggregates = [f"{base}/reclaimed", f"{base}/dedicated", f"{base}/shared", f"{base}/system"]
            sample = self.sampler.sample(now, [*aggregates, *(paths.values() if per_workload else ())])
            if sample is not None:
                self.usage.update(sample.per_cgroup_millicpu)
                self.cpu_usage = sample.per_cpu_millicpu
                self._observe(sample, now, epoch)
            if watch:
                self._last_watch = now
                self._release_empty(paths, now)
                live = set(aggregates) | set(paths.values())
                self.sampler.forget(live)
                self.usage = {p: v for p, v in self.usage.items() if p in live}
            if self.config.resize and sample is not None:
                self._resize(sample)
            self._refresh_capacity(now, epoch)
            self._evict_overcommit(now)
            self._advance_lending(epoch)
            self.reconcile()
        if self.net is not None:
            try:
                self.net.adjust()
            except Exception as exc:  # noqa: BLE001 - shaping trouble must not stop cpu isolation
                log.error("network shaping: %s", exc)

    def _observe(self, sample, now: float, epoch: float) -> None:
        base = self.config.cgroup_base
        offline = sample.per_cgroup_millicpu.get(f"{base}/reclaimed", 0)
        dedicated = sample.per_cgroup_millicpu.get(f"{base}/dedicated", 0)
        self.online_millicpu = max(0, sample.total_millicpu - offline - dedicated)
        try:
            import psutil

            memory = psutil.virtual_memory()
            used = memory.total - memory.available
        except Exception:  # noqa: BLE001
            used = 0
        offline_bytes = self.driver.memory_usage_bytes(f"{base}/reclaimed") or 0
        self.online_bytes = max(0, used - offline_bytes)
        self.estimator.observe(now, epoch, self.online_millicpu, self.online_bytes, self._online_per_node(sample, now))
        hour = self.estimator.history.key(epoch)
        if getattr(self, "_saved_hour", None) != hour or int(now) % 60 == 0:
            self._saved_hour = hour
            try:
                self.estimator.history.save()
            except OSError as exc:
                log.warning("cannot save usage history: %s", exc)

    def _online_per_node(self, sample, now: float) -> Optional[Dict[int, int]]:
        """Online millicpu on each NUMA node's cpus: per-cpu busy less the reclaimed and
        dedicated trees' per-cpu use (v1 ``cpuacct.usage_percpu``); ``None`` without it."""
        other = [read() for read in self._percpu_readers]
        if any(v is None for v in other) or not sample.per_cpu_millicpu:
            return None
        total_ns = [sum(values) for values in zip(*other)]
        last = getattr(self, "_percpu_last", None)
        self._percpu_last = (now, total_ns)
        if last is None or now <= last[0] or len(last[1]) != len(total_ns):
            return None
        elapsed = now - last[0]
        per_node: Dict[int, int] = {}
        for cpu, busy in sample.per_cpu_millicpu.items():
            if cpu >= len(total_ns):
                continue
            offline = (total_ns[cpu] - last[1][cpu]) / 1e9 / elapsed * 1000
            numa = self.topology.cpu(cpu).numa
            if numa is not None:
                per_node[numa] = per_node.get(numa, 0) + max(0, round(busy - offline))
        return per_node

    def _release_empty(self, paths: Dict[str, str], now: float) -> None:
        state = self.state
        for alloc in list(state.allocations):
            if alloc.qos is QoS.SYSTEM or alloc.source != LOCAL:
                continue  # another source (the API server, for a pod) says when it is gone
            procs = self.driver.procs(paths[alloc.name])
            if procs:
                self.seen_procs[alloc.name] = True
                continue
            age = now - self.created_at.get(alloc.name, now)
            if self.seen_procs.get(alloc.name) or age >= self.config.empty_grace:
                log.info("releasing %s: its cgroup is empty", alloc.name)
                state = state.without(alloc.name)
                self.seen_procs.pop(alloc.name, None)
                self.created_at.pop(alloc.name, None)
                self.counters["released_empty"] += 1
        if state is not self.state:
            self._commit(state)

    def _resize(self, sample) -> None:
        lay = _layout(self.topology, self.state)
        if self.lending.current.state == OFFLINE:
            shared_target = lay.shared_need  # lent: everything not needed goes to offline
        else:
            shared_target = self.sizer.update(self.online_millicpu, lay.shared_need, len(lay.free))
        lendable = len(self._pools().lendable)
        target = lendable + max(0, len(lay.free) - shared_target)
        if target != self.state.reclaim_cpus:
            self._commit(self.state.with_reclaim_cpus(target))

    def _harvests_shared(self) -> bool:
        return harvests(self.config.cgroup_options, self.driver.features)

    def _memory_total(self) -> int:
        """The node's memory: /proc/meminfo on the live host (node meminfo can lag
        behind hot-plugged memory, as on this project's VMs), else the NUMA nodes'."""
        if self.config.root == "/":
            try:
                import psutil

                return psutil.virtual_memory().total
            except Exception:  # noqa: BLE001
                pass
        return sum(n.memory_bytes or 0 for n in self.topology.numa_nodes)

    def _allocatable(self, state: State) -> tuple:
        """(millicpu, bytes) offline could hold if online used nothing."""
        pool = self._pools(state)
        lay = _layout(self.topology, state)
        if self._harvests_shared():
            cpus = len(lay.free) + len(lay.reserved) + len(pool.lendable)
        else:
            cpus = len(pool.reclaimed)
        total = self._memory_total()
        reserve = self.config.memory_reserved_bytes
        if reserve is None:
            reserve = max(1024 * MIB, total // 20)
        return cpus * 1000, max(0, total - reserve)

    def _estimate(self, state: State, now: float, epoch: float) -> Capacity:
        requests = (state.totals.shared_millicpu, self.online_bytes)
        allocatable = self._allocatable(state)
        numa = []
        if self.topology.numa_nodes:
            total_cpus = max(1, len(self.topology.online_cpus()))
            for node in self.topology.numa_nodes:
                share = len(node.cpus) / total_cpus
                numa.append((node.id, int(allocatable[0] * share), int(allocatable[1] * share)))
        capacity = self.estimator.estimate(now, epoch, allocatable, requests, tuple(numa))
        if not self._harvests_shared():
            # without idle-priority harvest, offline owns the reclaim pool's cpus, which the
            # sizer already fits to online demand; only memory comes from the estimate
            return Capacity(allocatable[0], capacity.memory_bytes, capacity.source, capacity.numa)
        return capacity

    def _with_capacity(self, state: State, now: Optional[float] = None, epoch: Optional[float] = None) -> State:
        """``state`` with its reclaimed capacity (admission and the quota cap) brought up to date."""
        now = time.monotonic() if now is None else now
        epoch = time.time() if epoch is None else epoch
        capacity = self._estimate(state, now, epoch)
        self._set_capacity(capacity, epoch)
        return state.with_reclaim_capacity(capacity.millicpu)

    def _set_capacity(self, capacity: Capacity, epoch: float) -> None:
        with self.changed:
            self._set_capacity_locked(capacity, epoch)

    def _set_capacity_locked(self, capacity: Capacity, epoch: float) -> None:
        old = self.capacity
        key = lambda c: None if c is None else (c.millicpu, c.memory_bytes, c.numa)  # noqa: E731
        if key(old) != key(capacity) or getattr(self, "_node_key", None) != self.lending.current:
            self._node_key = self.lending.current
            self.capacity = capacity
            self.generation += 1
            self.updated_at = epoch
            self.changed.notify_all()
            if self.pusher is not None and self.topology is not None and self.state is not None:
                self.pusher.submit(self.capacity_doc())
        else:
            self.capacity = capacity

    def _refresh_capacity(self, now: float, epoch: float) -> None:
        state = self._with_capacity(self.state, now, epoch)
        if state != self.state:
            self._commit(state)

    def _evict(self, alloc: Allocation, reason: str, epoch: Optional[float] = None) -> None:
        pids = [pid for path in self.cgroups_of(alloc) for pid in self.driver.kill(path, self.kill_signal)]
        record = {"name": alloc.name, "qos": alloc.qos.value, "tier": alloc.tier.value if alloc.qos is QoS.RECLAIMED
                  else None, "millicpu": alloc.millicpu, "reason": reason, "pids": pids,
                  "at": time.time() if epoch is None else epoch}
        self.evictions.append(record)
        del self.evictions[:-200]
        if alloc.qos is QoS.RECLAIMED:
            self.evictions_by_tier[alloc.tier.value] += 1
        log.warning("evicted %s (%s, %d pids): %s", alloc.name, record["tier"] or alloc.qos.value, len(pids), reason)
        self._commit(self.state.without(alloc.name))
        self.placements.pop(alloc.name, None)
        self.seen_procs.pop(alloc.name, None)
        self.created_at.pop(alloc.name, None)

    def _evict_overcommit(self, now: float) -> None:
        capacity = self.state.reclaim_millicpu
        if capacity is None:
            return
        victims = choose_victims(self.state.allocations, capacity)
        if not victims:
            self.overcommit_since = None
            return
        if self.overcommit_since is None:
            self.overcommit_since = now  # throttled by the quota from now on
            log.info("reclaimed work over-committed (%d millicpu of capacity); throttled", capacity)
        if now - self.overcommit_since < self.config.eviction_grace:
            return
        for alloc in victims:
            self._evict(alloc, f"reclaimed capacity fell to {capacity} millicpu and stayed there "
                               f"{self.config.eviction_grace:g}s")
        self.overcommit_since = None

    def _advance_lending(self, epoch: float) -> None:
        online = [a for a in self.state.allocations if a.qos in (QoS.DEDICATED, QoS.SHARED)]
        reclaimed = [a for a in self.state.allocations if a.qos is QoS.RECLAIMED]
        before = self.lending.current
        action = self.lending.advance(epoch, len(online), len(reclaimed), self.config.online_policy)
        if action == "evict-online":
            for alloc in online:
                self._evict(alloc, "the node is being lent and the notice ended", epoch)
            self.lending.advance(epoch, 0, len(reclaimed), self.config.online_policy)
        elif action == "evict-reclaimed":
            for alloc in reclaimed:
                self._evict(alloc, "the node is taken back and the notice ended", epoch)
            self.lending.advance(epoch, len(online), 0, self.config.online_policy)
        if self.lending.current != before:
            log.info("node state %s -> %s", before.state, self.lending.current.state)
            self._refresh_capacity(time.monotonic(), epoch)
            with self.changed:
                self.changed.notify_all()

    # ---- capacity and node state for offline agents ------------------------

    def capacity_doc(self) -> Dict[str, Any]:
        with self.lock:
            cap = self.capacity or Capacity(0, 0, "requests")
            node = self.lending.current
            pool = self._pools()
            doc = {
                "node_state": node.state, "generation": self.generation,
                "updated_at": _iso(self.updated_at), "valid_seconds": max(30, int(math.ceil(3 * self.config.period))),
                "source": cap.source,
                "reclaimed": {
                    "millicpu": cap.millicpu, "memory_bytes": cap.memory_bytes,
                    "cpus": format_cpulist(reclaimed_cpus(pool, self._harvests_shared())),
                    "numa": [{"id": n, "millicpu": c, "memory_bytes": m} for n, c, m in cap.numa],
                },
            }
            if node.state == TO_ONLINE:
                doc["deadline"] = _iso(node.deadline) if node.deadline else None
                doc["target"] = {"millicpu": 0, "memory_bytes": 0}
            if node.state == TO_OFFLINE:
                doc["deadline"] = _iso(node.deadline) if node.deadline else None
            return doc

    def wait_capacity(self, generation: int, timeout: float) -> Dict[str, Any]:
        """Long-poll: return once the generation differs from ``generation`` (or after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.generation == generation:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    break
                self.changed.wait(min(remaining, 1.0))
        return self.capacity_doc()

    def node_doc(self) -> Dict[str, Any]:
        node = self.lending.current
        return {"state": node.state, "since": _iso(node.since) if node.since else None,
                "deadline": _iso(node.deadline) if node.deadline else None, "notice_seconds": node.notice_seconds,
                "online_policy": self.config.online_policy, "hooks": self.lending.hook_results[-10:]}

    def lend(self, notice: Any) -> Dict[str, Any]:
        return self._transition(self.lending.lend, notice)

    def take_back(self, notice: Any) -> Dict[str, Any]:
        return self._transition(self.lending.reclaim, notice)

    def _transition(self, move, notice: Any) -> Dict[str, Any]:
        """Start a lending transition, then act on it at once (capacity, kernel, long-pollers)."""
        seconds = parse_notice(notice)
        with self.lock:
            try:
                move(time.time(), seconds)
            except TransitionError as exc:
                raise Conflict(str(exc)) from None
            self._advance_lending(time.time())
            self._refresh_capacity(time.monotonic(), time.time())
            self.changed.notify_all()  # the lock is held; long-pollers see the new node state
            self.reconcile()
            return self.node_doc()

    # ---- run / stop --------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    # ---- the fast guard: online gets its cores back between periods ---------

    def start_guard(self) -> None:
        if self.config.guard_interval <= 0 or self.config.record_cgroups or not self.config.resize:
            return
        threading.Thread(target=self._guard_loop, name="tidal-guard", daemon=True).start()

    def _guard_loop(self) -> None:
        """Every ``guard_interval``: online usage over the last interval from the
        online cgroups' cpu counters (two file reads; nanosecond counters, so one
        interval is enough). When online saturates its pool while cpus are lent,
        take them all back now instead of at the next period. A false alarm costs
        offline work a few periods of lending; a miss would cost online latency."""
        base = self.config.cgroup_base
        readers = [self.driver.usage_reader(p) for p in (f"{base}/shared", f"{base}/system")]
        history: List[tuple] = []
        while not self._stop.is_set():
            time.sleep(self.config.guard_interval)  # Event.wait(timeout) costs ~10x the cpu of a sleep
            now = time.monotonic()
            total = sum(read() or 0 for read in readers)
            history.append((now, total))
            del history[:-2]
            if len(history) < 2:
                continue
            (t0, u0), (t1, u1) = history[0], history[-1]
            rate = (u1 - u0) / 1e6 / max(1e-6, t1 - t0)  # millicpu
            with self.lock:
                pool = self._pools()
                carved = not set(pool.reclaimed) <= set(pool.lendable)  # cpus carved from the shared pool
                online_cpus = len(pool.shared) + len(pool.reserved)
                if carved and rate >= self.sizer.saturation * online_cpus * 1000:
                    self.shrink_now(rate)

    def shrink_now(self, online_millicpu: float) -> None:
        """Give the shared pool every lent cpu and cut the capacity, in the kernel, now."""
        with self.lock:
            lay = _layout(self.topology, self.state)
            self.sizer.force(len(lay.free), int(online_millicpu))
            lendable = len(self._pools().lendable)
            self.estimator.observe(time.monotonic(), time.time(), int(online_millicpu), self.online_bytes)
            state = self._with_capacity(self.state.with_reclaim_cpus(lendable))
            self._commit(state)
            self.counters["fast_shrinks"] = self.counters.get("fast_shrinks", 0) + 1
            self.reconcile()

    def serve(self) -> None:
        from agent.api import serve_agent

        self._server = serve_agent(self, self.config.socket_path, self.config.tcp_port, self.config.api_poll_interval,
                                   socket_group=self.config.socket_group, tcp_token=self.config.tcp_token)

    def run(self) -> int:
        from agent import sdnotify

        # handlers first: a SIGTERM that arrives while starting must still stop cleanly
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            self.serve()
            self.start_guard()
            if self.on_started is not None:
                self.on_started()
            self.echo(f"tidal agent: serving {self.config.socket_path}"
                      + (f" and 127.0.0.1:{self.config.tcp_port}" if self.config.tcp_port else "")
                      + f"; state {self.store.path}; pid {os.getpid()}; stop with SIGTERM or Ctrl-C")
            sdnotify.notify("READY=1\nSTATUS=serving " + self.config.socket_path)
            watchdog = sdnotify.watchdog_enabled()
            while not self._stop.wait(self.config.period):
                if watchdog:
                    sdnotify.notify("WATCHDOG=1")
                try:
                    self.tick()
                except TidalError as exc:
                    log.error("reconcile loop: %s", exc)
                except Exception:  # noqa: BLE001 - a bug in one period must not unconfine workloads
                    log.exception("reconcile loop failed; continuing")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.state is not None:
                self.shutdown()
        return 0

    def shutdown(self) -> None:
        from agent import sdnotify

        sdnotify.notify("STOPPING=1")
        self._stop.set()
        with self.changed:
            self.changed.notify_all()  # wake long-pollers
        if self._server is not None:
            self._server.close()
        if self.pusher is not None:
            self.pusher.close()
        if self.net is not None:
            # what Tidal added to the network goes with a clean stop (a crash leaves it, and a restart adopts it)
            try:
                removed = self.net.revert()
                self.echo(f"tidal agent: network shaping removed ({removed['qdiscs']} qdiscs, {removed['ingress']} "
                          f"ingress redirects, {removed['nft_tables']} nft tables, {removed['rules_routes']} rules/routes)")
            except Exception as exc:  # noqa: BLE001
                self.echo(f"tidal agent: warning: removing network shaping: {exc}")
            self.net = None
        if self.config.revert_on_exit and self.reconciler is not None:
            with self.lock:
                report = self.reconciler.revert()
                self._commit(State(reserved=self.state.reserved))
                try:
                    os.unlink(self._originals_path())
                except OSError:
                    pass
            self.echo(f"tidal agent: reverted: removed {len(report.removed)} cgroups, "
                      f"restored {len(report.written)} values, {len(report.failed)} failures")
        self.echo("tidal agent: stopped")

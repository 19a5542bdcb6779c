"""The node agent (``tidal agent``): the services of ``agent.services`` wired and run.

Start:
1. discover the topology; detect cgroups (v1 or v2) and build the driver;
2. load the checkpoint (corrupt or missing: rebuilt from the cgroup tree, see
   ``isolation.cgroups.recover``); adopt saved original values for revert;
3. reconcile the kernel to the state (writes only differences), so workloads
   that ran through an agent crash stay confined;
4. serve the local API (unix socket, mode 0600; optional loopback TCP).

Every period (default 1 s): sample usage; release local workloads whose
cgroups have been empty (after a grace period for new ones); resize the
reclaim pool from online usage; refresh the reclaimed capacity; evict what no
longer fits; move the lending state on; reconcile (repairing drift made by
others, counted); the checkpoint is written on every change of the state.

SIGTERM/SIGINT: stop serving, keep the state and the cgroups (workloads keep
running, confined). ``--revert``: also put the kernel back as found.

``Agent`` is the wiring and the one face the API, the Kubernetes node agent,
metrics and benchmarks use; the work is the services' (one job each).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional

from agent.errors import AdmissionError, Conflict, NotFound, TidalError, Unfit  # noqa: F401 - part of the face
from agent.helper_process import HelperJoin
from agent.isolation.cgroups.desired import HELPERS, CgroupOptions
from agent.isolation.cgroups.detect import CgroupError, detect
from agent.isolation.cgroups.driver import CgroupDriver, KernelCgroups
from agent.isolation.cgroups.layout import check_base
from agent.isolation.cgroups.reconcile import ReconcileReport
from agent.isolation.cgroups.recover import recover_state
from agent.lending import NodeLending
from agent.qrm.assignment import cpu_owners, reclaimed_cpus, system_cpus
from agent.qrm.model import LOCAL, Allocation, QoS
from agent.qrm.policy import State, smt_siblings_held_back
from agent.qrm.state import CheckpointStore
from agent.statefiles import check_state_dir
from agent.services.admission import Admission
from agent.services.enforcement import Enforcement
from agent.services.eviction import Eviction
from agent.services.harvest import Harvest
from agent.services.protection import MemoryProtection
from agent.services.usage import Usage
from agent.services.lending import Lending, iso
from agent.services.owner import StateOwner, StateView
from agent.topology import HostFS, Topology, discover
from agent.topology.parse import format_cpulist

log = logging.getLogger("tidal.agent")

DEFAULT_SOCKET = "/run/tidal/tidal.sock"
DEFAULT_STATE_DIR = "/var/lib/tidal"
# the NRI plugin refreshes its copy of the assignments every 250 ms; silent this long, it is gone
NRI_FRESH_SECONDS = 10.0


def kubelet_pod_of_self(proc_cgroup: str = "/proc/self/cgroup") -> Optional[str]:
    """The kubelet pod cgroup this process runs in (a ``kubepods`` path in /proc/self/cgroup), if any."""
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split(":", 2)[-1]
        if "/kubepods" in path or path.startswith("kubepods"):
            return path
    return None


def systemd_unit_of_self(proc_cgroup: str = "/proc/self/cgroup", pid1: str = "/proc/1/comm") -> Optional[str]:
    """The systemd service or scope whose cgroup this process runs in (cgroup v2's path, e.g.
    ``/system.slice/tidal.service``), where systemd is PID 1; else None."""
    try:
        with open(pid1) as handle:
            if handle.read().strip() != "systemd":
                return None
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            path = line[3:]
            return path if path.rsplit("/", 1)[-1].endswith((".service", ".scope")) else None
    return None


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
    cgroups_in_memory: bool = False  # keep cgroup writes in memory (dry runs, end-to-end tests off the host)
    confine_self: bool = False  # move the agent itself into <base>/system (the reserved pool)
    host_units: tuple = ()  # systemd units not Tidal's held on the reserved cpus (services.host_units)
    kubelet_cpu_manager: Optional[str] = None  # on a Kubernetes node: the kubelet's CPU manager policy
    eviction_grace: float = 10.0  # over-committed reclaimed work is throttled this long before eviction
    memory_evict_below: Optional[int] = None  # evict reclaimed work under this MemAvailable (None: 2%, 256 MiB-2 GiB)
    memory_pressure_threshold: float = 20.0  # percent of online's memory stall time that evicts reclaimed work (0: off)
    cpu_pressure_threshold: float = 20.0  # percent of online's cpu wait time that takes lent cpus back (0: off)
    io_pressure_threshold: float = 20.0  # percent of online's io wait time that limits offline's block io (0: off)
    online_policy: str = "wait"  # lending: "wait" for online workloads to finish, or "evict" them at the notice end
    hooks: Dict[str, List[str]] = field(default_factory=dict)  # node state -> argv run on entering it
    memory_reserved_bytes: Optional[int] = None  # kept from offline agents (default: 5% of memory, at least 1 GiB)
    push_command: Optional[List[str]] = None  # argv run with the capacity on every change
    push_url: Optional[str] = None  # POSTed the capacity (YARN shape) on every change
    push_format: str = "yarn"
    push_resend: float = 10.0  # seconds between re-sends of an unchanged capacity (a restarted RM/NM forgot it)
    yarn_rm: Optional[str] = None  # a ResourceManager's web address: Tidal sets its node's resource (agent.reporter.yarn)
    yarn_node_id: Optional[str] = None  # default: found in the RM's node list by host name
    yarn_node_host: Optional[str] = None  # the NodeManager's host name, where it is not this host's
    offline_cgroups: tuple = ()  # cgroups (from the hierarchy's root) whose use is offline, not online
    # offline daemons' cgroups (YARN NodeManagers): offline, never evicted; their containers go to Tidal's
    # reclaimed tree (services.offline_containers)
    yarn_nodemanager_cgroups: tuple = ()
    yarn_container_tier: str = "low"
    guard_interval: float = 0.05  # the fast guard's sampling interval (0: off)
    api_poll_interval: float = 0.5  # how often idle API threads wake (shutdown latency vs idle cpu)
    drift_check_period: float = 30.0  # seconds between full reads of the cgroup tree (drift repair)
    watch_period: float = 10.0  # seconds between checks for emptied workloads
    usage_period: float = 10.0  # seconds between per-workload usage samples (pool aggregates: every period)
    cgroup_options: CgroupOptions = field(default_factory=CgroupOptions)
    net: Optional[Any] = None  # isolation.net.policy.NetConfig: shape traffic of these NICs
    socket_group: Optional[int] = None  # a gid whose members may use the socket with a user's authority
    tcp_token: Optional[str] = None  # bearer token that lets TCP clients write (agent.authority)
    plugin_socket: Optional[str] = None  # a read-only socket for the NRI plugin, owned by plugin_uid
    plugin_uid: int = 0  # the NRI plugin's uid: the plugin socket's owner
    max_workloads_per_user: int = 64  # workloads one non-root uid may hold through the socket
    reclaim_buffer: float = 0.2  # headroom kept above online's recent peak (contracts.headroom), a fraction
    reclaimed_on_smt_siblings: bool = False  # reclaimed work may use dedicated cpus' SMT siblings (policy.pools)
    lending_notice: float = 60.0  # seconds of notice for lending driven by the node's label (Kubernetes)
    # tunables (agent.tunables) set on this node by a flag or the config file: a cluster policy leaves them
    local_settings: frozenset = frozenset()




class Agent:
    def __init__(self, config: AgentConfig, echo: Callable[[str], None] = print,
                 driver: Optional[CgroupDriver] = None, topology: Optional[Topology] = None) -> None:
        self.config = config
        self.echo = echo
        self.driver = driver
        self.owner = StateOwner(CheckpointStore(os.path.join(config.state_dir, "checkpoint.json")))
        self.owner.topology = topology
        self.lending = NodeLending(os.path.join(config.state_dir, "node.json"), config.hooks)
        self.counters: Dict[str, int] = {"drift_repairs": 0, "reconciles": 0, "reconcile_failures": 0,
                                         "released_empty": 0, "fast_shrinks": 0, "pressure_throttles": 0,
                                         "cpu_pressure_shrinks": 0, "io_pressure_throttles": 0}
        # what a monitoring system needs beyond counters: when the loop last ran, when each report to the
        # cluster was last known current (wall clock), and conflicts with other node software now
        self.last_period_at: Optional[float] = None
        self.reports: Dict[str, float] = {}
        self.conflicts: Dict[str, str] = {}
        # the tunables in force, each (value, source: local, policy or default), and the cluster policy
        # this node follows (agent.k8s.policy), or None
        self.tuned: Dict[str, tuple] = {}
        self.policy: Optional[Dict[str, Any]] = None
        self.helper_join = HelperJoin()  # moves push commands and hooks into <base>/helpers once it exists
        self.lending.helper_join = self.helper_join
        self.pusher = self._pusher(config)
        self.net = None  # NetShaper when config.net is set
        self.host_units = None  # services.host_units.HostUnits with --confine-host-units
        self._host_units_verified = time.monotonic()
        self.on_started: Optional[Callable[[], None]] = None  # e.g. the Kubernetes pod source
        # the services, built by start() once the topology and the driver are known
        self.enforcement: Optional[Enforcement] = None
        self.harvest: Optional[Harvest] = None
        self.usage: Optional[Usage] = None
        self.admission: Optional[Admission] = None
        self.eviction: Optional[Eviction] = None
        self.node: Optional[Lending] = None
        self._stop = threading.Event()
        self._paths = (None, {}, {})
        self._last_watch = -1e18
        self._last_usage = -1e18
        self._server = None

    def _pusher(self, config: AgentConfig):
        from agent.reporter.push import CommandTarget, Pusher, UrlTarget

        targets = []
        if config.push_command:
            targets.append(CommandTarget(config.push_command, config.push_format, join=self.helper_join))
        if config.push_url:
            targets.append(UrlTarget(config.push_url, config.push_format))
        if config.yarn_rm:
            from agent.reporter.yarn import YarnTarget

            targets.append(YarnTarget(config.yarn_rm, config.yarn_node_id, config.yarn_node_host))
        return Pusher(targets, resend_s=config.push_resend) if targets else None

    # ---- the state, as readers see it ---------------------------------------------------------

    topology = property(lambda self: self.owner.topology)
    lock = property(lambda self: self.owner.lock)
    changed = property(lambda self: self.owner.changed)
    store = property(lambda self: self.owner.store)
    placements = property(lambda self: self.owner.placements)

    @property
    def state(self) -> Optional[State]:
        return self.owner.state

    @state.setter
    def state(self, value: State) -> None:
        self.owner.state = value

    def pools(self, state: Optional[State] = None):
        return self.owner.pools(state)

    def view(self) -> StateView:
        return self.owner.view()

    # ---- start -------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        owner = self.owner
        try:
            check_base(cfg.cgroup_base)
        except ValueError as exc:
            raise CgroupError(str(exc)) from None
        if cfg.host_units and not cfg.cgroups_in_memory:
            self._check_host_units()
        if owner.topology is None:
            owner.topology = discover(HostFS(cfg.root))
        if self.driver is None and cfg.cgroups_in_memory:
            from agent.isolation.cgroups.recording import RecordingCgroups

            self.driver = RecordingCgroups(version=1)
            self.echo("tidal agent: cgroups in memory (--cgroups-in-memory): nothing is written to the kernel, so "
                      "the fast guard, self-confinement, the helpers' cgroup, the lifting of io limits and the "
                      "node's available memory are off")
        if self.driver is None:
            mounts = detect(HostFS(cfg.root))
            self.driver = KernelCgroups(mounts, HostFS(cfg.root), parent=cfg.cgroup_parent)
            if cfg.cgroup_options.host_cgroups:
                self._check_host_cgroups()  # before prepare: a refusal leaves nothing made
            moved = self.driver.prepare(cfg.cgroup_base)  # checks first: one clear error, nothing made
            if moved:
                self.echo(f"tidal agent: cgroup v2 holds no processes where controllers are distributed: moved "
                          f"{len(moved)} process(es) of {self.driver.bases['']} into {cfg.cgroup_base}/system")
        self._build_services()
        try:
            os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
        except OSError:
            pass  # check_state_dir says what is wrong with it
        check_state_dir(cfg.state_dir)  # one line, before any state file is read
        for warning in (self.harvest.start(), self.lending.load()):
            if warning:
                self.echo(f"tidal agent: warning: {warning}")
        result = owner.store.load(owner.topology, reserved=cfg.reserved_cpus,
                                  recover=lambda topo: recover_state(self.driver, cfg.cgroup_base, topo,
                                                                     cfg.reserved_cpus))
        for warning in result.warnings:
            self.echo(f"tidal agent: warning: {warning}")
        state = result.state
        if cfg.reserved_cpus is not None and tuple(cfg.reserved_cpus) != state.reserved:
            from agent.qrm.policy import initial_state

            check = initial_state(owner.topology, cfg.reserved_cpus)
            clash = set(check.reserved) & set(owner.pools(state).dedicated)
            if clash:
                raise AdmissionError(f"reserved cpus {format_cpulist(clash)} are held by dedicated workloads")
            state = replace(state, reserved=check.reserved)
        # an option, not a part of the checkpoint: the flag of this start decides
        state = replace(state, reclaim_siblings=cfg.reclaimed_on_smt_siblings)
        owner.state = self.harvest.with_capacity(state)
        warning = self.enforcement.load_originals()
        if warning:
            self.echo(f"tidal agent: warning: {warning}")
        self.admission.track_all()
        self.admission.homeless()  # a checkpoint whose every cpu is reserved or dedicated keeps no reclaimed work
        from agent.tunables import resolve

        self.tune(resolve(cfg, cfg.local_settings, {}))  # this node's own settings until a cluster policy comes
        report = self.reconcile()
        owner.store.save(owner.state, owner.topology)
        if not cfg.cgroups_in_memory:
            # Tidal starts unthrottled: the first reconcile lifted what an earlier agent left
            lifted = report.io_lifted
            if lifted:
                self.echo(f"tidal agent: lifted {len(lifted)} io limits an earlier agent left ({', '.join(lifted)})")
        if not cfg.cgroups_in_memory:  # helpers (push commands, hooks) run in <base>/helpers from now on
            self.helper_join.join = lambda pid: self.enforcement.membership.attach(f"{cfg.cgroup_base}/{HELPERS}", pid)
        if cfg.net is not None:
            self._start_net()
        in_pod = kubelet_pod_of_self()
        # with its tree under its own cgroup (--cgroup-parent self) the agent settled inside it already
        unit = systemd_unit_of_self() if cfg.cgroup_parent == "/" and self.driver.version == 2 else None
        if cfg.confine_self and in_pod:
            # a DaemonSet pod: leaving the pod's cgroups would take the agent out of its limits and out of
            # the kubelet's accounting; the pod is placed like any other (deploy/ annotates it system_cores)
            self.echo(f"tidal agent: in the kubelet's pod cgroup {in_pod}: staying there (its pod sets its cpus)")
        elif cfg.confine_self and not cfg.cgroups_in_memory and owner.pools().reserved and unit:
            # a systemd service (the shipped unit): leaving its cgroup would take the agent out of the unit's
            # MemoryMax= and systemd's accounting (make test-systemd found it in <base>/system, the unit's
            # limit over nothing); it stays, on the reserved cpus by affinity, every thread
            cpus = set(owner.pools().reserved)
            self.enforcement.membership.pin_self(cpus)
            self.echo(f"tidal agent: in systemd's {unit}: staying there (its limits and accounting); "
                      f"on the reserved cpus {format_cpulist(cpus)} by affinity")
        elif cfg.confine_self and not cfg.cgroups_in_memory and owner.pools().reserved:
            try:
                self.enforcement.membership.attach(f"{cfg.cgroup_base}/system", os.getpid())
            except CgroupError as exc:
                self.echo(f"tidal agent: warning: cannot move the agent into the system pool: {exc}")
        if cfg.host_units and not cfg.cgroups_in_memory:
            self._hold_host_units()
        topo = owner.topology
        self.echo(
            f"tidal agent: {len(topo.socket_ids())} sockets, {len(topo.numa_nodes)} NUMA nodes, "
            f"{len(topo.core_ids())} cores, {len(topo.online_cpus())} cpus; cgroup v{self.driver.version}; "
            f"{len(owner.state.allocations)} workloads ({result.source}); "
            f"{len(report.written)} cgroup writes, {len(report.failed)} failures")
        for warning in topo.warnings:
            self.echo(f"tidal agent: warning: {warning}")

    def _build_services(self) -> None:
        cfg, owner = self.config, self.owner
        units = None
        if isinstance(self.driver, KernelCgroups) and self.driver.version == 2 and os.path.abspath(cfg.root) == "/":
            # the kubelet's systemd driver makes its pods' cgroups systemd units: Tidal's values there are asked
            # of systemd too (its bus is reached at the first such value; a host without one never dials it)
            from agent.isolation.systemd import UnitProperties
            units = UnitProperties()
        # where the agent's own process lives decides the weight of Tidal's top cgroup (desired.base_weight):
        # in the tree when start() moves it into <base>/system (a host agent outside systemd and outside a
        # pod), or when the tree is under its own cgroup; else in its pod or its systemd unit
        unit = systemd_unit_of_self() if cfg.cgroup_parent == "/" and self.driver.version == 2 else None
        in_tree = cfg.cgroup_parent == "self" or (cfg.confine_self and not kubelet_pod_of_self() and not unit)
        options = replace(cfg.cgroup_options, agent_in_tree=in_tree)
        self.enforcement = Enforcement(owner, self.driver, cfg.cgroup_base, options, cfg.state_dir,
                                       cfg.drift_check_period, self.counters, limits=lambda: self.harvest.limits(),
                                       protection=lambda: self.harvest.protection.current(),
                                       confined=lambda: self.harvest.confined(),
                                       io_limits=lambda: self.harvest.io_guard.knob(), units=units)
        self.usage = Usage(owner, self.enforcement, cfg)
        protection = MemoryProtection(self.enforcement, self.usage.online_cgroups)
        self.harvest = Harvest(owner, self.enforcement, self.lending, cfg, self.counters,
                               os.path.join(cfg.state_dir, "history.json"), self.usage, protection)
        if self.pusher is not None:
            self.harvest.on_change = lambda: self.pusher.submit(self.capacity_doc())
        self.admission = Admission(owner, self.enforcement, self.harvest, self.lending, cfg.empty_grace,
                                   self.counters, max_per_user=cfg.max_workloads_per_user)
        self.eviction = Eviction(owner, self.enforcement, cfg.eviction_grace, self.admission.forget,
                                 cfg.memory_evict_below, cfg.memory_pressure_threshold)
        self.admission.homeless = lambda: self.eviction.homeless(self.enforcement.harvest)
        self.node = Lending(owner, self.lending, self.eviction, self.harvest, self.enforcement, cfg.online_policy)
        self.containers = None
        if cfg.yarn_nodemanager_cgroups:
            from agent.services.offline_containers import OfflineContainers

            self.containers = OfflineContainers(
                cfg.yarn_nodemanager_cgroups, self.enforcement.membership.offline_procs,
                admit=lambda doc: self.admission.admit(doc), attach=self.admission.attach,
                exists=lambda name: self.owner.state.get(name) is not None, tier=cfg.yarn_container_tier)
            # kept between containers: one that YARN starts during a lending notice (YARN was shown the
            # floor at its start) joins it; admitting it anew then is refused (nothing new in a transition)
            standing = frozenset(self.containers.workloads().values())
            self.admission.standing = lambda: standing

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

    # ---- the face: each call goes to the service whose job it is --------------------------------

    def reconcile(self, verify: Optional[bool] = None) -> ReconcileReport:
        return self.enforcement.reconcile(verify)

    def _check_host_units(self) -> None:
        """Before anything is made: the units can be held here, and none of them holds Tidal's tree."""
        cfg = self.config
        if not os.path.isdir("/run/systemd/system"):
            raise TidalError("--confine-host-units: systemd does not run this host (no /run/systemd/system)")
        own = systemd_unit_of_self() or ""
        for held in cfg.host_units:
            if cfg.cgroup_parent == "self" and f"/{held}/" in f"{own}/":
                raise TidalError(f"--confine-host-units {held}: Tidal's tree would live under it ({own}, "
                                 f"--cgroup-parent self); leave it out or use --cgroup-parent /")

    def _check_host_cgroups(self) -> None:
        """Before anything is made: a host without systemd (it owns the tree and rewrites what it made),
        and every cgroup named there."""
        if os.path.isdir("/run/systemd/system"):
            raise TidalError("--confine-host-cgroups: systemd runs this host and owns its cgroups; hold its units "
                             "with --confine-host-units instead")
        for path in self.config.cgroup_options.host_cgroups:
            if not self.driver.present(path):
                raise TidalError(f"--confine-host-cgroups {path}: no such cgroup "
                                 f"({', '.join(sorted(set(self.driver.where(path).values())))})")

    def _host_cgroups_status(self) -> Optional[Dict[str, Any]]:
        named = self.config.cgroup_options.host_cgroups
        if not named:
            return None
        held = self.enforcement.host_tree()
        return {"named": list(named), "held": list(held), "cpus": format_cpulist(system_cpus(self.owner.pools())),
                "missing": [p for p in named if p not in held]}

    def _hold_host_units(self) -> None:
        """``--confine-host-units``: systemd holds those units on the reserved cpus from now on."""
        from agent.isolation.systemd import SystemdUnits
        from agent.services.host_units import HostUnits

        cfg = self.config
        self.host_units = HostUnits(cfg.host_units, SystemdUnits(), cfg.state_dir,
                                    self.owner.topology.online_cpus(), self.echo)
        self.host_units.hold(self.owner.pools().reserved)

    def admit(self, doc: Any, source: str = LOCAL, owner: Optional[int] = None) -> Dict[str, Any]:
        return self.admission.admit(doc, source, owner)

    def release(self, name: str) -> None:
        self.admission.release(name)

    def place(self, name: str, paths) -> None:
        self.admission.place(name, paths)

    def rename(self, old: str, new: str, label: Optional[str] = None) -> None:
        self.admission.rename(old, new, label)

    def owner_of(self, name: str) -> Optional[int]:
        return self.admission.owner_of(name)

    def cgroups_of(self, alloc: Allocation) -> tuple:
        return self.enforcement.cgroups_of(alloc)

    def attach(self, name: str, pid: Any) -> Dict[str, Any]:
        return self.admission.attach(name, pid)

    def describe(self, alloc: Allocation, pool=None) -> Dict[str, Any]:
        return self.admission.describe(alloc, pool)

    def workloads(self) -> List[Dict[str, Any]]:
        return self.admission.workloads()

    def assignments(self) -> Dict[str, Any]:
        return self.admission.assignments()

    def runtime_seen(self, nri_state: str) -> None:
        self.nri_seen = (nri_state, time.monotonic())

    def runtime_integration(self) -> Dict[str, Any]:
        """Which road applies pods' cpusets: the runtime through Tidal's NRI plugin (registered and heard
        from within NRI_FRESH_SECONDS), else the agent's own writes of the kubelet's cgroups (always on:
        they write the same values, and are the whole road where the runtime has no NRI)."""
        state, at = getattr(self, "nri_seen", (None, 0.0))
        age = time.monotonic() - at if state else None
        live = state == "registered" and age is not None and age < NRI_FRESH_SECONDS
        return {"pods_confined_by": "nri+kubelet-cgroups" if live else "kubelet-cgroups",
                "nri_plugin": state if age is not None and age < NRI_FRESH_SECONDS else "not heard from",
                "nri_last_heard_seconds": round(age, 1) if age is not None else None}

    def join_offline(self, cgroup: Any, pid: Any) -> Dict[str, Any]:
        """Put ``pid`` in a declared offline cgroup (an offline system's daemon: ``tidal run --offline-cgroup``)."""
        declared = tuple(self.config.offline_cgroups) + tuple(self.config.yarn_nodemanager_cgroups)
        path = cgroup.strip("/") if isinstance(cgroup, str) else None
        if path not in {c.strip("/") for c in declared}:
            raise AdmissionError(f"cgroup must be one of the agent's --offline-cgroup or --yarn-nodemanager-cgroup "
                                 f"({', '.join('/' + c.strip('/') for c in declared) or 'none declared'}), "
                                 f"got {str(cgroup)[:80]!r}")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise AdmissionError(f"pid must be a positive integer, got {str(pid)[:40]!r}")
        try:
            self.enforcement.membership.join_offline(path, pid)
        except CgroupError as exc:
            raise AdmissionError(f"cannot move pid {pid} into /{path}: {exc}") from None
        return {"cgroup": "/" + path, "pid": pid}

    def lend(self, notice: Any) -> Dict[str, Any]:
        return self.node.lend(notice)

    def take_back(self, notice: Any) -> Dict[str, Any]:
        return self.node.take_back(notice)

    def node_doc(self) -> Dict[str, Any]:
        return self.node.doc()

    def shrink_now(self, online_millicpu: float) -> None:
        self.harvest.guard.shrink_now(online_millicpu)

    def start_guard(self) -> None:
        self.harvest.guard.start(self._stop)

    def status(self) -> Dict[str, Any]:
        with self.lock:
            pool = self.pools()
            topo = self.topology
            owner = cpu_owners(pool, self.state.allocations)
            cpus = [{"id": c, "numa": topo.cpu(c).numa, "core": topo.cpu(c).core,
                     **dict(zip(("pool", "workload"), owner.get(c, ("unassigned", None)))),
                     "usage_millicpu": self.usage.by_cpu.get(c)} for c in topo.online_cpus()]
            sources: Dict[str, int] = {}
            for alloc in self.state.allocations:
                sources[alloc.source] = sources.get(alloc.source, 0) + 1
            siblings = smt_siblings_held_back(topo, self.state)
            return {
                "cgroup_version": self.driver.version, "cgroup_base": self.config.cgroup_base,
                "dedicated_isolation": self.enforcement.dedicated_isolation(),
                "pools": {k: format_cpulist(v) for k, v in pool.to_dict().items()},
                "reclaim_cpus_target": self.state.reclaim_cpus, "reclaimed_capacity_millicpu": self.state.reclaim_millicpu,
                # SMT: the sibling threads of dedicated cpus reclaimed work may not use (policy.pools), and why
                "smt": {"threads_per_core": max((len(topo.cpus_in_core(c)) for c in topo.core_ids()), default=1),
                        "reclaimed_on_siblings": self.state.reclaim_siblings,
                        "held_back": [{"cpu": c, "sibling_of": siblings[c]} for c in pool.held_back]},
                "workloads": len(self.state.allocations), "workloads_by_source": sources,
                "cpus": cpus, "counters": dict(self.counters),
                "evictions_by_tier": dict(self.eviction.by_tier), "evictions_by_cause": dict(self.eviction.by_cause),
                "recent_evictions": self.eviction.evictions[-20:],
                "memory": self.memory_status(),
                "cpu_pressure": self.cpu_pressure_status(),
                "io_pressure": self.io_pressure_status(),
                # reclaimed workloads kept off online's idle cpus: they run in the kernel (services.kernel_work)
                "kernel_work": {"confined": sorted(self.harvest.kernel_work.names()),
                                "probation": sorted(self.harvest.confined() - self.harvest.kernel_work.names()),
                                "kernel_millicpu": dict(self.harvest.kernel_work.kernel_millicpu),
                                "confinements": self.harvest.kernel_work.confinements,
                                # with nothing lent: each one's wait at the minimum quota, and all waits'
                                "waiting_seconds": self.harvest.kernel_work.waiting(),
                                "waited_seconds_total": round(self.harvest.kernel_work.waited_seconds, 1)},
                "node_state": self.lending.current.state,
                "online_millicpu": self.usage.online_millicpu,
                "offline_cgroups": [{"path": p, "millicpu": self.usage.offline_usage.get(p)}
                                    for p in self.usage.offline_cgroups],
                "push": self.pusher.records() if self.pusher is not None else [],
                "offline_containers": self.containers.status() if self.containers is not None else None,
                "host_units": self.host_units.status() if self.host_units is not None else None,
                "host_cgroups": self._host_cgroups_status(),
                "last_reconcile_ms": round(self.enforcement.last_reconcile_ms, 3),
                "state_file": self.store.path, "socket": self.config.socket_path,
                "runtime": {**self.runtime_integration(), "kubelet_cpu_manager": self.config.kubelet_cpu_manager},
                "conflicts": dict(self.conflicts),
                "policy": self.policy,
                "settings": {key: {"value": value, "source": source} for key, (value, source) in self.tuned.items()},
                # connection slots per listener (agent.connections): who holds them, how many were turned away
                "api": self._server.status() if self._server is not None else None,
            }

    # ---- settings that change while running (agent.tunables) ----------------------------

    def tune(self, resolution: Dict[str, tuple]) -> Dict[str, Any]:
        """Apply ``{key: (value, source)}`` to the running loops; the keys whose value changed."""
        with self.lock:
            changed = {k: v for k, (v, _) in resolution.items() if self.tuned.get(k, (object(),))[0] != v}
            lifted = False
            harvest, eviction = self.harvest, self.eviction
            for key, value in changed.items():
                if key == "memory-pressure-threshold":
                    lifted |= harvest.throttle.set_threshold(value)
                    eviction.memory_pressure_threshold = value
                elif key == "cpu-pressure-threshold":
                    lifted |= harvest.cpu_loop.set_threshold(value)
                elif key == "io-pressure-threshold":  # where the kernel can limit block io at all
                    lifted |= harvest.io_guard.throttle.set_threshold(value if self.driver.features.get("io") else 0.0)
                elif key == "eviction-grace":
                    eviction.grace = value
                elif key == "memory-evict-below":
                    eviction.memory_evict_below = value
                elif key == "reclaim-buffer":
                    harvest.sizer.buffer = harvest.estimator.buffer = value
            self.tuned = dict(resolution)
            if lifted and self.enforcement is not None and not self._stop.is_set():
                self.reconcile()  # a loop turned off lets go of what it held, now
            return changed

    def apply_policy(self, policy: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """Follow a cluster policy (``{"name", "generation", "agent": spec.agent}``), or none: each tunable
        that is not set on this node takes the policy's value, else its default."""
        from agent.tunables import from_policy, resolve

        values, refused = from_policy(policy.get("agent") if policy else None)
        changed = self.tune(resolve(self.config, self.config.local_settings, values))
        with self.lock:
            self.policy = None if policy is None else {
                "name": policy["name"], "generation": policy.get("generation"),
                "applied": sorted(k for k in values if k not in self.config.local_settings),
                "kept_local": sorted(k for k in values if k in self.config.local_settings),
                "refused": refused}
        if changed:
            log.info("settings %s: %s", f"of policy {policy['name']} (generation {policy.get('generation')})"
                     if policy else "back to this node's own", ", ".join(f"{k}={v}" for k, v in sorted(changed.items())))
        return changed

    def cpu_pressure_status(self) -> Dict[str, Any]:
        """Online's cpu wait share (PSI) and what it did to lending; io's, for the record (status, metrics)."""
        cpu, io, loop = self.harvest.cpu_pressure, self.harvest.io_pressure, self.harvest.cpu_loop
        return {"online_cpu_percent": cpu.percent, "online_cpu_avg10": cpu.avg10, "scope": cpu.scope,
                "threshold_percent": loop.threshold, "shrinks": self.counters.get("cpu_pressure_shrinks", 0),
                "lending_held_periods": loop.holding, "online_io_percent": io.percent}

    def io_pressure_status(self) -> Dict[str, Any]:
        """Online's io wait share (PSI) and the limits it put on offline's block io (status, metrics)."""
        io = self.harvest.io_pressure
        return {"online_io_percent": io.percent, "scope": io.scope, "supported": bool(self.driver.features.get("io")),
                "throttles": self.counters.get("io_pressure_throttles", 0), **self.harvest.io_guard.status()}

    def memory_status(self) -> Dict[str, Any]:
        """The node's memory as the eviction causes see it (status, metrics)."""
        total = self.harvest.memory_total()
        meter = self.harvest.memory_pressure
        return {"total_bytes": total, "available_bytes": self.usage.available_bytes,
                "evict_below_bytes": self.eviction.watermark(total),
                "online_bytes": self.usage.online_bytes,
                "reclaimed_bytes": self.usage.offline_bytes,
                # memory.low in force (v2; None on v1, which has none): per cgroup holding online processes
                "protected_bytes": sum(v for _, v in self.harvest.protection.current())
                if self.driver.features.get("memory_protection") else None,
                "protection": dict(self.harvest.protection.current()),
                "online_pressure_percent": meter.percent, "online_pressure_avg10": meter.avg10,
                "pressure_scope": meter.scope, "pressure_threshold_percent": self.eviction.memory_pressure_threshold,
                "offline_throttled_to_bytes": self.harvest.throttle.limit,
                "pressure_throttles": self.counters.get("pressure_throttles", 0)}

    # ---- the loop ----------------------------------------------------------

    def tick(self, now: Optional[float] = None, epoch: Optional[float] = None) -> None:
        """One period of the loop (exposed for tests; the clocks may be passed in)."""
        now = time.monotonic() if now is None else now
        epoch = time.time() if epoch is None else epoch
        with self.lock:
            if self._paths[0] is not self.state or self._paths[2] != self.placements:
                # the cgroup each workload's usage is read from: its leaf, or the first of its placement
                self._paths = (self.state, {a.name: self.cgroups_of(a)[0] for a in self.state.allocations
                                            if self.cgroups_of(a)}, dict(self.placements))
            paths = self._paths[1]
            watch = now - self._last_watch >= self.config.watch_period
            per_workload = now - self._last_usage >= self.config.usage_period
            if per_workload:
                self._last_usage = now
            sampled = self.harvest.sample(now, epoch, paths.values() if per_workload else ())
            if watch:
                self._last_watch = now
                self.admission.release_empty(paths, now)
                self.usage.forget(paths.values())
            if self.containers is not None:
                self.containers.adopt()
            if self.config.resize and sampled:
                self.harvest.resize()
            self.harvest.refresh(now, epoch)
            self.eviction.overcommit(now)
            # memory runs out in seconds: the available figure is read every period, not sampled
            self.eviction.memory(now, self.usage.read_available(), self.harvest.memory_total(),
                                 self.harvest.memory_pressure.percent)
            self.node.advance(epoch)
            self.reconcile()
            if self.host_units is not None:  # asks systemd when the reserved pool changed (or failed), and
                # reads the units back as often as the cgroup tree is read for drift
                verify = time.monotonic() - self._host_units_verified >= self.config.drift_check_period
                if verify:
                    self._host_units_verified = time.monotonic()
                self.host_units.hold(self.owner.pools().reserved, verify=verify)
            self.last_period_at = epoch
        if self.net is not None:
            try:
                self.net.adjust()
            except Exception as exc:  # noqa: BLE001 - shaping trouble must not stop cpu isolation
                log.error("network shaping: %s", exc)

    # ---- capacity and node state for offline agents ------------------------

    def capacity_doc(self) -> Dict[str, Any]:
        with self.lock:
            numbers = self.harvest.capacity_numbers()
            doc = {
                "node_state": self.lending.current.state, "generation": self.harvest.generation,
                "updated_at": iso(self.harvest.updated_at), "valid_seconds": numbers["valid_seconds"],
                "source": numbers["source"],
                "reclaimed": {
                    "millicpu": numbers["millicpu"], "memory_bytes": numbers["memory_bytes"],
                    "cpus": format_cpulist(reclaimed_cpus(self.pools(), self.enforcement.harvest)),
                    "numa": numbers["numa"],
                },
            }
            doc.update(self.node.capacity_fields())
            return doc

    def wait_capacity(self, generation: int, timeout: float) -> Dict[str, Any]:
        """Long-poll: return once the generation differs from ``generation`` (or after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.harvest.generation == generation:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    break
                self.changed.wait(min(remaining, 1.0))
        return self.capacity_doc()

    # ---- run / stop --------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    def serve(self) -> None:
        from agent.api import serve_agent

        self._server = serve_agent(self, self.config.socket_path, self.config.tcp_port, self.config.api_poll_interval,
                                   socket_group=self.config.socket_group, tcp_token=self.config.tcp_token,
                                   plugin_socket=self.config.plugin_socket, plugin_uid=self.config.plugin_uid)

    def run(self) -> int:
        from agent import sdnotify

        import faulthandler

        # handlers first: a SIGTERM that arrives while starting must still stop cleanly
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        # SIGUSR1: every thread's stack on stderr (the journal, the pod's log), the agent running on: what an
        # agent that does not stop, or stalls, is doing (docs/operations.md)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
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
        if not self.lending.wait_hooks(timeout=5):
            self.echo("tidal agent: warning: a lending hook is still running; it is left to finish")
        if self.net is not None:
            # what Tidal added to the network goes with a clean stop (a crash leaves it, and a restart adopts it)
            try:
                removed = self.net.revert()
                self.echo(f"tidal agent: network shaping removed ({removed['qdiscs']} qdiscs, {removed['ingress']} "
                          f"ingress redirects, {removed['nft_tables']} nft tables, {removed['rules_routes']} rules/routes)")
            except Exception as exc:  # noqa: BLE001
                self.echo(f"tidal agent: warning: removing network shaping: {exc}")
            self.net = None
        if self.enforcement is not None and not self.config.cgroups_in_memory:
            if self.harvest.io_guard.lift_all() and not self.config.revert_on_exit:
                self.enforcement.reconcile()  # Tidal starts unthrottled: its io limits go with it
        if self.config.revert_on_exit and self.host_units is not None:
            if self.host_units.release():
                self.echo("tidal agent: host units given back their own cpus"
                          + (f" ({len(self.host_units.errors)} refused)" if self.host_units.errors else ""))
        if self.config.revert_on_exit and self.enforcement is not None:
            with self.lock:
                report = self.enforcement.revert()
                self.owner.commit(State(reserved=self.state.reserved))
            self.echo(f"tidal agent: reverted: removed {len(report.removed)} cgroups, "
                      f"restored {len(report.written)} values, {len(report.failed)} failures")
        if self.harvest is not None and self.harvest.pressure_files is not None:
            self.harvest.pressure_files.close()  # the period's meters read no more (the guard closes its own)
        self.echo("tidal agent: stopped")

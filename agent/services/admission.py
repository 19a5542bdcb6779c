"""Admission: workloads in and out, from every source, by one road.

* ``admit(doc, source, owner)``: the request is parsed, checked against the
  node's lending state, decided by ``qrm.allocate`` and committed; the kernel
  is reconciled at once, and a workload whose cgroup cannot be set up is
  taken out again (nothing half-applied).
* ``place(name, paths)``: where a workload of another source lives (a pod's
  cgroups); ``attach(name, pid)``: a process into a local workload's cgroup.
* ``release``: by the API, or by the workload's source: a local workload
  when its cgroup stayed empty (``release_empty``: after ``empty_grace`` for
  one that never had a process; never a ``standing`` one), a pod when the
  API server says it is gone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional

from agent.errors import AdmissionError, Conflict, NotFound, Unfit
from agent.isolation.cgroups.desired import pod_weight
from agent.isolation.cgroups.detect import CgroupError
from agent.lending import OFFLINE, TO_OFFLINE, TO_ONLINE, NodeLending
from agent.qrm.assignment import assignment
from agent.authority import check_admit
from agent.qrm.model import KUBERNETES, LOCAL, SOURCES, Allocation, QoS, Rejection
from agent.qrm.policy import allocate, release
from agent.qrm.requests import machine_limits, parse_request
from agent.services.enforcement import Enforcement
from agent.services.harvest import Harvest
from agent.services.owner import StateOwner
from agent.topology.parse import format_cpulist

log = logging.getLogger("tidal.agent")


class Admission:
    def __init__(self, owner: StateOwner, enforcement: Enforcement, harvest: Harvest, lending: NodeLending,
                 empty_grace: float, counters: Dict[str, int], max_per_user: int = 64) -> None:
        self.owner = owner
        self.enforcement = enforcement
        self.harvest = harvest
        self.lending = lending
        self.empty_grace = empty_grace
        self.counters = counters
        self.max_per_user = max_per_user
        # evicts reclaimed work left with no cpu (services.eviction.homeless), before the kernel is told
        self.homeless: Callable[[], Any] = lambda: None
        # local workloads kept while empty: an offline system's containers' (services.offline_containers),
        # which its daemon fills and empties all day
        self.standing: Callable[[], Any] = frozenset
        self.seen_procs: Dict[str, bool] = {}
        self.created_at: Dict[str, float] = {}

    def track_all(self) -> None:
        """At start: every workload of the checkpoint starts its empty-cgroup grace now."""
        now = time.monotonic()
        for alloc in self.owner.state.allocations:
            self.created_at[alloc.name] = now
            self.seen_procs[alloc.name] = False

    def forget(self, name: str) -> None:
        self.seen_procs.pop(name, None)
        self.created_at.pop(name, None)

    def admit(self, doc: Any, source: str = LOCAL, owner: Optional[int] = None) -> Dict[str, Any]:
        """Admit a request from ``source`` (see ``qrm.model.SOURCES``): the source, not Tidal's
        tree, later says when the workload is gone."""
        if source not in SOURCES:
            raise ValueError(f"unknown workload source {source!r}")
        state_owner = self.owner
        # a pod's workload is named by its source (contracts.pods); the local API's names never look like one
        request = parse_request(doc, limits=machine_limits(state_owner.topology),
                                pod=source == KUBERNETES)  # AdmissionError -> 400
        with state_owner.lock:
            if owner is not None:
                owned = sum(1 for a in state_owner.state.allocations if a.owner == owner)
                check_admit(owner, request.qos.value, owned, self.max_per_user)  # Forbidden -> 403
            node = self.lending.current.state
            if node in (TO_OFFLINE, TO_ONLINE):
                raise Conflict(f"the node is {node}: nothing new is placed during a transition")
            if node == OFFLINE and request.qos in (QoS.DEDICATED, QoS.SHARED):
                raise Conflict("the node is lent (Offline): only reclaimed_cores and system_cores are placed")
            state_owner.state = self.harvest.with_capacity(state_owner.state)
            decision = allocate(state_owner.topology, state_owner.state, request)
            if isinstance(decision, Rejection):
                if "already in use" in decision.reason:
                    raise Conflict(decision.reason)
                raise Unfit(f"{decision.name}: {decision.reason}")
            decision = replace(decision, source=source, owner=owner, label=request.label)
            state_owner.commit(self.harvest.with_capacity(state_owner.state.with_allocation(decision)))
            self.created_at[decision.name] = time.monotonic()
            self.seen_procs[decision.name] = False
            self.homeless()
            report = self.enforcement.reconcile()
            mine = set(self.enforcement.cgroups_of(decision))
            failed = [f for f in report.failed if f[0] in mine]
            if failed:
                state_owner.commit(state_owner.state.without(decision.name))
                self.enforcement.reconcile()
                raise CgroupError(f"{decision.name}: cgroup setup failed: {failed[0][2]}")
            return self.describe(decision)

    def release(self, name: str) -> None:
        owner = self.owner
        with owner.lock:
            if owner.state.get(name) is None:
                raise NotFound(f"no workload named {name!r}")
            alloc = owner.state.get(name)
            paths = set(self.enforcement.cgroups_of(alloc)) if alloc.source == LOCAL else set()
            owner.commit(self.harvest.with_capacity(release(owner.state, name)))
            owner.placements.pop(name, None)
            self.forget(name)
            report = self.enforcement.reconcile()
            failed = [f for f in report.failed if f[0] in paths]
            if failed:  # released from the state; the kernel kept its cgroup (the next pass tries again)
                raise CgroupError(f"{name} released, but its cgroup was not removed: {failed[0][2]}")

    def _of_another_source(self, name: str, why_not_local: str) -> Allocation:
        """The workload ``name`` (NotFound), which must be of a source other than ``local`` (Conflict)."""
        alloc = self.owner.state.get(name)
        if alloc is None:
            raise NotFound(f"no workload named {name!r}")
        if alloc.source == LOCAL:
            raise Conflict(f"{name} is a local workload: {why_not_local}")
        return alloc

    def rename(self, old: str, new: str, label: Optional[str] = None) -> None:
        """Give a workload of another source the name its source now gives it (a pod an older agent
        named ``<namespace>.<name>``, now ``pod/<uid>``): same cpus, same everything, no kernel write."""
        owner = self.owner
        with owner.lock:
            self._of_another_source(old, "its name is its cgroup's")
            if owner.state.get(new) is not None:
                raise Conflict(f"name {new!r} is already in use")
            renamed = tuple(replace(a, name=new, label=label) if a.name == old else a
                            for a in owner.state.allocations)
            owner.commit(replace(owner.state, allocations=renamed))
            if old in owner.placements:
                owner.placements[new] = owner.placements.pop(old)
            for table in (self.created_at, self.seen_procs):
                if old in table:
                    table[new] = table.pop(old)

    def place(self, name: str, paths) -> None:
        """Say where a workload's processes live (cgroups its source's owner made, parent first,
        e.g. a pod's cgroup then its containers'); the Reconciler writes its assignment there
        from now on. Only for workloads of a source other than ``local``."""
        paths = tuple(paths)
        owner = self.owner
        with owner.lock:
            self._of_another_source(name, "its processes live in Tidal's tree")
            if owner.placements.get(name) != paths:
                owner.placements[name] = paths
                self.enforcement.reconcile()

    def owner_of(self, name: str) -> Optional[int]:
        """The uid that admitted workload ``name`` through the socket (None: root); NotFound if none."""
        with self.owner.lock:
            alloc = self.owner.state.get(name)
            if alloc is None:
                raise NotFound(f"no workload named {name!r}")
            return alloc.owner

    def attach(self, name: str, pid: Any) -> Dict[str, Any]:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise AdmissionError(f"pid must be a positive integer, got {pid!r}")
        with self.owner.lock:
            alloc = self.owner.state.get(name)
            if alloc is None:
                raise NotFound(f"no workload named {name!r}")
            if alloc.source != LOCAL:
                raise Conflict(f"{name} is a {alloc.source} workload: its processes are placed by its source")
            try:
                self.enforcement.membership.attach(self.enforcement.cgroups_of(alloc)[0], pid)
            except CgroupError as exc:
                # no such process, or one the kernel will not move (a kernel thread, a task of a
                # real-time group): the caller's pid, so a client mistake, never a 500
                raise AdmissionError(f"cannot attach pid {pid}: {exc}") from None
            self.seen_procs[name] = True
            return self.describe(alloc)

    def describe(self, alloc: Allocation, pool=None) -> Dict[str, Any]:
        owner, driver = self.owner, self.enforcement.driver
        pool = pool or owner.pools()
        given = assignment(owner.topology, alloc, pool, self.enforcement.harvests_for(alloc.name))
        paths = self.enforcement.cgroups_of(alloc)
        path = paths[0] if paths else None
        return {
            "name": alloc.name, "label": alloc.label, "qos": alloc.qos.value, "millicpu": alloc.millicpu, "source": alloc.source,
            "cpus": format_cpulist(given.cpus), "mems": format_cpulist(given.mems),
            "tier": alloc.tier.value if alloc.qos is QoS.RECLAIMED else None,
            "numa_binding": alloc.numa_binding, "numa_exclusive": alloc.numa_exclusive, "gpus": list(alloc.gpus),
            "cgroup": path, "cgroups": list(paths), "cgroup_dirs": driver.where(path) if path else {},
            "partition": self.enforcement.reconciler.partition_of(path) if path and alloc.qos is QoS.DEDICATED
            else None,
            "pids": sorted({pid for p in paths for pid in driver.procs(p)}),
            "usage_millicpu": self.harvest.usage.by_cgroup.get(path) if path else None,
            **({"limit_millicpu": alloc.limit_millicpu} if alloc.limit_millicpu is not None else {}),
        }

    def assignments(self) -> Dict[str, Any]:
        """What each workload is given now, from memory only (no kernel read: the NRI plugin asks it
        inside the runtime's deadline): cpus, mems, QoS level and cpu weight, by workload name."""
        with self.owner.lock:
            pool = self.owner.pools()
            given = {}
            for alloc in self.owner.state.allocations:
                one = assignment(self.owner.topology, alloc, pool, self.enforcement.harvests_for(alloc.name))
                # a pod's cpu priority as the Reconciler writes it (isolation.cgroups.desired.pod_weight),
                # a local workload's as its cgroup in Tidal's tree has it
                shares = pod_weight(one, self.enforcement.driver.features).get("cpu_shares") if alloc.source != LOCAL else one.cpu_shares
                given[alloc.name] = {"qos": alloc.qos.value, "cpus": format_cpulist(one.cpus),
                                     "mems": format_cpulist(one.mems), "cpu_shares": shares,
                                     "cpu_idle": one.cpu_idle}
            return {"assignments": given}

    def workloads(self) -> List[Dict[str, Any]]:
        with self.owner.lock:
            pool = self.owner.pools()
            return [self.describe(a, pool) for a in self.owner.state.allocations]

    def release_empty(self, paths: Dict[str, str], now: float) -> None:
        """Local workloads whose cgroup stayed empty: released (another source's never are)."""
        owner = self.owner
        state = owner.state
        standing = self.standing()
        for alloc in list(state.allocations):
            if alloc.qos is QoS.SYSTEM or alloc.source != LOCAL or alloc.name in standing:
                continue  # another source (the API server, for a pod) says when it is gone
            procs = self.enforcement.driver.procs(paths[alloc.name])
            if procs:
                self.seen_procs[alloc.name] = True
                continue
            age = now - self.created_at.get(alloc.name, now)
            if self.seen_procs.get(alloc.name) or age >= self.empty_grace:
                log.info("releasing %s: its cgroup is empty", alloc.name)
                state = state.without(alloc.name)
                self.forget(alloc.name)
                self.counters["released_empty"] += 1
        if state is not owner.state:
            owner.commit(state)

"""Enforcement: the state, as assignments, into the kernel through the one Reconciler.

Every workload source ends here: ``qrm.assignment`` says what each workload
gets, ``desired_tree`` says where (Tidal's tree, or the cgroups a pod's
processes live in), and the ``Reconciler`` writes the difference. Original
values of cgroups Tidal did not make are kept beside the checkpoint
(``originals.json``) so a restarted agent can still revert.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, Callable, Dict, Optional, Set, Tuple

from agent.isolation.cgroups.desired import CgroupOptions, desired_tree, harvests, partitions, takes_idle
from agent.isolation.cgroups.driver import CgroupDriver
from agent.isolation.cgroups.layout import workload_path
from agent.isolation.membership import Membership
from agent.isolation.cgroups.reconcile import Reconciler, ReconcileReport
from agent.qrm.model import LOCAL, Allocation
from agent.services.owner import StateOwner
from agent.statefiles import load_json, write_json

log = logging.getLogger("tidal.agent")


class Enforcement:
    def __init__(self, owner: StateOwner, driver: CgroupDriver, base: str, options: CgroupOptions, state_dir: str,
                 drift_check_period: float, counters: Dict[str, int],
                 limits: Callable[[], Tuple[Optional[int], Optional[int], Optional[int]]],
                 protection: Callable[[], Tuple[Tuple[str, int], ...]] = tuple,
                 confined: Callable[[], frozenset] = frozenset, io_limits: Callable[[], tuple] = tuple,
                 units=None) -> None:
        """``limits()``: the reclaimed parent's (cpu cap millicpu, memory max bytes, memory high bytes or
        ``None`` for the default) now;
        ``protection()``: the online trees' ``memory.low`` now, ``((tree, bytes), ...)``;
        ``confined()``: the reclaimed workloads kept off online's idle cpus now (``services.kernel_work``);
        ``io_limits()``: offline's block io limits now, ``((device, read_bps, write_bps), ...)``
        (``services.io_guard``);
        ``units``: systemd, asked to hold Tidal's values of the kubelet's units (``isolation.systemd``)."""
        self.owner = owner
        self.driver = driver
        self.membership = Membership(driver)  # moves and signals: isolation.membership
        self.base = base
        self.options = options
        self.drift_check_period = drift_check_period
        self.protection = protection
        self.confined = confined
        self.io_limits = io_limits
        self.counters = counters
        self.limits = limits
        self.reconciler = Reconciler(driver, base, units=units)
        self._unheld_said: Optional[str] = None  # why systemd could not hold values, as the log last said
        self.originals_path = os.path.join(state_dir, "originals.json")
        self.last_report: Optional[ReconcileReport] = None
        self._pending_said: Set[str] = set()  # removals the kernel refused that the log has named
        self.last_reconcile_ms = 0.0
        self._last_verify = -1e18
        self._reconciled_key = None

    @property
    def harvest(self) -> bool:
        """Reclaimed work takes the shared pool's idle time (the kernel has cpu.idle, the option is on)."""
        return harvests(self.options, self.driver.features)

    def harvests_for(self, name: str) -> bool:
        """Whether reclaimed workload ``name`` takes online's idle cpus now (not when it runs in the kernel)."""
        return takes_idle(replace(self.options, confined=self.confined()), self.driver.features, name)

    def dedicated_isolation(self) -> Dict[str, object]:
        """How dedicated workloads' cpus are kept theirs: cpuset partitions, or plain cpusets and why."""
        mode = partitions(self.options, self.driver.features)
        refused = dict(self.reconciler.partition_refused)
        if mode is not None:
            return {"mode": f"partition ({mode})", "why": None, "refused": refused}
        if self.options.dedicated_partition == "none":
            why = "--dedicated-partition none"
        elif self.driver.version == 1:
            why = "cgroup v1 has no cpuset partitions"
        else:
            why = "this kernel has no cpuset.cpus.exclusive (partitions below Tidal's tree need Linux >= 6.7)"
        return {"mode": "cpuset", "why": why, "refused": refused}

    def cgroups_of(self, alloc: Allocation) -> Tuple[str, ...]:
        """The cgroups a workload's processes live in: its placement, else its leaf in Tidal's tree."""
        if alloc.source != LOCAL:
            return tuple(self.owner.placements.get(alloc.name, ()))
        return (workload_path(self.base, alloc),)

    def reconcile(self, verify: Optional[bool] = None) -> ReconcileReport:
        """Apply the state to the kernel. ``verify``: read the whole tree back and
        repair drift (default: when ``drift_check_period`` has passed)."""
        owner = self.owner
        with owner.lock:
            start = time.perf_counter()
            if verify is None:
                verify = start - self._last_verify >= self.drift_check_period
            if verify:
                self._last_verify = start
            # the reclaimed parent's cpu and memory limits (the current capacity) and its memory throttle
            cap, memory, high = self.limits()
            options = replace(self.options, base=self.base, reclaimed_cap_millicpu=cap, reclaimed_memory_max=memory,
                              reclaimed_memory_high=self.options.reclaimed_memory_high if high is None else high,
                              online_memory_low=self.protection(), confined=self.confined(),
                              offline_io_max=self.io_limits(), host_cgroups=self.host_tree())
            # the state object itself, compared by identity (an id() could be reused once freed); with
            # placements the Reconciler looks every pass (a pod's cgroups appear when the kubelet makes them)
            last = self._reconciled_key
            # (a removal the kernel refused a moment ago is tried again every pass until it is done)
            unchanged = (last is not None and last[0] is owner.state and last[1] == options
                         and last[2] == owner.placements and not owner.placements
                         and not (self.last_report is not None and self.last_report.pending))
            if not verify and unchanged and self.last_report is not None:
                return ReconcileReport()  # nothing changed since the last pass: no work at all
            self._reconciled_key = (owner.state, options, dict(owner.placements))
            specs = desired_tree(owner.topology, owner.state, owner.pools(), options, self.driver.features,
                                 owner.placements)
            report = self.reconciler.apply(specs, verify=verify)
            self.last_reconcile_ms = (time.perf_counter() - start) * 1000
            self.counters["reconciles"] += 1
            self.counters["drift_repairs"] += len(report.repaired)
            self.counters["reconcile_failures"] += len(report.failed)
            for path, file, was, now in report.repaired:
                log.warning("repaired %s/%s: found %r, wrote %r", path, file, was, now)
            for path, file, error in report.failed:
                log.error("cgroup write failed: %s", error)
            for path, reason in report.pending:
                if path not in self._pending_said:  # once per cgroup: the passes until it goes say nothing
                    log.info("%s: its processes are still exiting; removed once they are gone (%s)", path, reason)
                    self.counters["removals_waited"] = self.counters.get("removals_waited", 0) + 1
            self._pending_said = {path for path, _ in report.pending}
            for item in report.reenabled:
                log.warning("controller taken away from %s: enabled again", item)
            self.counters["controller_repairs"] = self.counters.get("controller_repairs", 0) + len(report.reenabled)
            for path, reason in report.partitions_refused:
                log.warning("%s: cpuset partition refused, a plain cpuset instead: %s", path, reason)
            for path, pid in report.rejoined:
                log.warning("pid %d was in %s in some hierarchies only (a move cut short): moved in all", pid, path)
            self.counters["membership_repairs"] = self.counters.get("membership_repairs", 0) + len(report.rejoined)
            self.counters["unit_holds"] = self.counters.get("unit_holds", 0) + len(report.held)
            reason = report.unheld[0][1] if report.unheld else None
            if reason is not None and reason != self._unheld_said:
                log.warning("systemd did not take the values of %d unit(s) (%s): their cgroup files hold them, and "
                            "a daemon-reload puts the units' own back until it does (asked again every pass)",
                            len({path for path, _ in report.unheld}), reason)
            self._unheld_said = reason if report.unheld else None
            self.last_report = report
            if self.reconciler.originals:
                self.save_originals()
            return report

    def host_tree(self) -> tuple:
        """``--confine-host-cgroups``: the cgroups named that exist now, parents first, and on v1 every
        cgroup below them (a v1 parent cannot narrow its cpuset below a child's: the children go first)."""
        out = []
        for path in self.options.host_cgroups:
            if not self.driver.present(path):
                continue
            out.append(path)
            if self.driver.version == 1:
                todo = [path]
                while todo:
                    parent = todo.pop(0)
                    below = [f"{parent}/{child}" for child in sorted(self.driver.children(parent))]
                    out += below
                    todo += below
        return tuple(sorted(dict.fromkeys(out), key=lambda p: p.count("/")))

    # ---- originals: what others' cgroups held before Tidal wrote them -------------------------

    def load_originals(self) -> Optional[str]:
        """Adopt the saved originals; a warning line when the file is unusable (kept as .bad-N)."""
        def parse(data: Any) -> list:
            rows = data.get("originals") if isinstance(data, dict) else None
            if not isinstance(rows, list) or not all(
                    isinstance(r, list) and len(r) == 4 and all(isinstance(x, str) for x in r[:3])
                    and (r[3] is None or isinstance(r[3], str)) for r in rows):
                raise ValueError("expected {\"originals\": [[path, controller, file, value], ...]}")
            return rows

        rows, warning = load_json(self.originals_path, parse, "original values of others' cgroups written before "
                                                              "are not known")
        if rows is not None:
            self.reconciler.adopt({"originals": rows})
        return warning

    def save_originals(self) -> None:
        data = self.reconciler.export()
        if data["originals"]:
            write_json(self.originals_path, data)

    def revert(self) -> ReconcileReport:
        report = self.reconciler.revert()
        try:
            os.unlink(self.originals_path)
        except OSError:
            pass
        return report

"""Reconcile the kernel's cgroups to a desired tree, writing only differences.

1. Remove cgroups of workloads that are gone (their leftover processes go
   back to the parent cgroup Tidal was given, where they would be without
   it); first, because a parent cannot narrow below a child that remains.
2. Create missing cgroups, parents first.
3. Widen cpusets top-down (each cgroup gets current | desired), so a child
   is never asked for cpus its parent lacks (v1 refuses that).
4. Narrow cpusets bottom-up (each gets exactly desired), children before
   parents for the same reason.
5. Quotas the same way: raised top-down, lowered bottom-up (v1 refuses a
   parent quota below a child's).
6. Write every other knob whose file differs from the desired value.

A cgroup the kernel will not remove yet (EBUSY: processes killed a moment ago still exiting, which
can be neither moved nor waited for) is a pending removal for ``REMOVAL_GRACE_S``, tried again every
pass, and a failure only once it stays longer (a process stuck in the kernel, someone else's child).

A file that differs although Tidal last wrote the desired value there was
changed by someone else: it is rewritten and counted as a drift repair.
Every write that fails is reported, and the rest still applied; nothing
stops half-way silently.

Files of cgroups Tidal did not create (the kubelet's, in Kubernetes mode)
have their original values saved before the first write, so ``revert``
restores exactly what was found. Such ``external`` cgroups are never created
or removed here: they are written once their owner made them (checked every
pass, so a pod cgroup the kubelet makes later is written within one period),
and forgotten (last values, originals) once they are no longer wanted or gone.

Such a cgroup that is a systemd unit (the kubelet's systemd driver: a pod's slice, the QoS classes'
slices) on cgroup v2 gets each value Tidal writes as the unit's runtime property too (``units``:
``isolation.systemd.UnitProperties``): systemd writes every unit's properties to its cgroup again at
``daemon-reload``, and a value held only in the file went back to the unit's, to be repaired by Tidal in
turn. The unit's properties before Tidal's first are kept with the files' originals and given back on
revert. One that systemd could not take (its bus unreachable) is asked again on later passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

from agent.isolation.cgroups.desired import CgroupSpec
from agent.isolation.cgroups.detect import CgroupError
from agent.isolation.cgroups.driver import CgroupDriver
from agent.isolation.cgroups.knobs import files_for, line_writes, normalize, satisfied
from agent.isolation.systemd import SystemdError, cgroup_properties, is_unit
from agent.topology.parse import format_cpulist, parse_cpulist
from contracts.eviction import TIERS

Key = Tuple[str, str, str]  # (path, controller, file)
CPUSET_KNOBS = ("cpus", "mems", "cpus_exclusive")
REMOVAL_GRACE_S = 10.0  # a removal the kernel refuses is pending this long before it is a failure
PARTITION_FILES = ("cpuset.cpus.exclusive", "cpuset.cpus.partition")
SYSTEMD = "systemd"  # the "controller" of a unit property's original: (path, SYSTEMD, property)


@dataclass
class ReconcileReport:
    created: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    written: List[Tuple[str, str, str]] = field(default_factory=list)
    repaired: List[Tuple[str, str, Optional[str], str]] = field(default_factory=list)
    failed: List[Tuple[str, str, str]] = field(default_factory=list)
    pending: List[Tuple[str, str]] = field(default_factory=list)  # (path, the kernel's word): removal refused, in grace
    rejoined: List[Tuple[str, int]] = field(default_factory=list)  # (path, pid) made whole across hierarchies
    partitions_refused: List[Tuple[str, str]] = field(default_factory=list)  # (path, the kernel's reason)
    reenabled: List[str] = field(default_factory=list)  # v2 "parent:controller" someone had taken away
    held: List[Tuple[str, str, str]] = field(default_factory=list)  # (unit's cgroup, property, value) systemd holds
    unheld: List[Tuple[str, str]] = field(default_factory=list)  # (unit's cgroup, why systemd could not hold it)

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def io_lifted(self) -> List[str]:
        """``"<cgroup> <device>"`` of each block io limit this pass lifted."""
        return [f"{path} {line.split()[0]}" for path, file, line in self.written
                if file == "io.max" and line.split()[1:] == ["rbps=max", "wbps=max"]]


def _union(a: Optional[str], b: str) -> str:
    try:
        left = set(parse_cpulist(a or ""))
    except ValueError:
        left = set()
    return format_cpulist(left | set(parse_cpulist(b)))


class Reconciler:
    def __init__(self, driver: CgroupDriver, base: str, managed_roots: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic, units=None) -> None:
        """``units``: an ``isolation.systemd.UnitProperties`` where systemd may own some of others' cgroups
        (``None``: files only)."""
        self.driver = driver
        self.units = units
        self._to_hold: Dict[Tuple[str, str], str] = {}  # (unit's cgroup, file) -> a value systemd did not take yet
        self.clock = clock
        self.refused_since: Dict[str, float] = {}  # cgroups whose removal the kernel refused, since when
        self.base = base
        self.last: Dict[Key, str] = {}
        self.originals: Dict[Key, Optional[str]] = {}
        self.created: Set[str] = set()
        self._drifted: Dict[Key, Optional[str]] = {}
        self._applied: Optional[tuple] = None
        self._cache: Dict[Key, Optional[str]] = {}
        self._trust_last = False  # this pass takes Tidal's own files to hold what it last wrote there
        # dedicated leaves whose cpuset partition the kernel refused: plain cpusets there, with the reason
        self.partition_refused: Dict[str, str] = {}
        self.managed_roots = tuple(managed_roots) or (f"{base}/dedicated", f"{base}/shared",
                                                      *[f"{base}/reclaimed/{t}" for t in TIERS])

    def _ours(self, path: str) -> bool:
        return path == self.base or path.startswith(self.base + "/") or path in self.created

    def _read(self, controller: str, path: str, file: str) -> Optional[str]:
        """One read per file per pass: the passes ask for the same files again. Between verifying passes
        a file of Tidal's own tree that Tidal wrote is not read at all: it holds what was last written
        (others' changes are found, and repaired, by the next verifying pass); others' cgroups (pods)
        are read every pass."""
        key = (path, controller, file)
        if key not in self._cache:
            if self._trust_last and key in self.last and self._ours(path):
                self._cache[key] = self.last[key]
            else:
                self._cache[key] = self.driver.read(controller, path, file)
        return self._cache[key]

    def _write(self, report: ReconcileReport, path: str, controller: str, file: str, text: str,
               final: bool = True) -> None:
        """Write ``text`` unless the file already holds it. ``final`` writes are
        what the cgroup should keep (remembered for drift detection); the
        widening pass writes intermediate values."""
        key = (path, controller, file)
        actual = self._read(controller, path, file)
        if satisfied(file, actual, text):
            if final:
                self.last[key] = text
            return
        if key not in self.originals and not self._ours(path):
            # v2: an empty cpuset.cpus/mems means "as the parent" and is kept as such (its .effective now
            # may already be a parent's narrowed set, as a container's is once its pod was written)
            self.originals[key] = actual
        try:
            lines = self._put(controller, path, file, actual, text)
        except CgroupError as exc:
            self._cache.pop(key, None)
            self.last.pop(key, None)  # what the file holds now is unknown (io.max: some lines may be in): read next pass
            if file in PARTITION_FILES:
                self._refuse(report, path, str(exc))
            else:
                report.failed.append((path, file, str(exc)))
            return
        self._cache[key] = text
        report.written += [(path, file, line) for line in lines]
        if final:
            if key in self._drifted:
                report.repaired.append((path, file, self._drifted[key], text))
            self.last[key] = text
            self._hold(report, path, file, text)

    def _hold(self, report: ReconcileReport, path: str, file: str, text: str) -> None:
        """A value Tidal wrote to another's cgroup that is a systemd unit: systemd holds it as the unit's."""
        if self.units is None or self.driver.version != 2 or self._ours(path):
            return
        unit = path.rsplit("/", 1)[-1]
        values = cgroup_properties(file, text) if is_unit(unit) else []
        if not values:
            return
        saved = [key[2] for key in self.originals if key[0] == path and key[1] == SYSTEMD]
        try:
            before = self.units.hold(unit, values, saved)
        except SystemdError as exc:
            self._to_hold[(path, file)] = text
            report.unheld.append((path, str(exc)))
            return
        self._to_hold.pop((path, file), None)
        for name, value in before.items():
            self.originals[(path, SYSTEMD, name)] = str(value)
        report.held += [(path, name, str(value)) for name, value in values]

    def _put(self, controller: str, path: str, file: str, actual: Optional[str], text: str) -> List[str]:
        """Write ``text`` over ``actual``: one write, or one per line that differs in a file of lines
        (``io.max``: the kernel takes a device per write); what was written."""
        lines = line_writes(file, actual, text)
        for line in lines:
            self.driver.write(controller, path, file, line)
        return lines

    def _refuse(self, report: ReconcileReport, path: str, reason: str) -> None:
        """A cpuset partition the kernel refused: recorded once, and the cgroup stays a plain cpuset."""
        if path not in self.partition_refused:
            self.partition_refused[path] = reason
            report.partitions_refused.append((path, reason))

    def _without_refused(self, specs: List[CgroupSpec]) -> List[CgroupSpec]:
        """Specs with plain cpusets where a partition was refused (a leaf, or every leaf when an
        exclusive set on a parent was refused)."""
        if not self.partition_refused:
            return specs
        out = []
        for spec in specs:
            if "partition" in spec.knobs and (spec.path in self.partition_refused or any(
                    spec.path.startswith(p + "/") for p in self.partition_refused)):
                knobs = {k: v for k, v in spec.knobs.items() if k not in ("cpus_exclusive", "partition")}
                knobs["partition"] = "member"
                spec = CgroupSpec(spec.path, knobs, spec.workload, spec.external)
            elif "cpus_exclusive" in spec.knobs and spec.path in self.partition_refused:
                spec = CgroupSpec(spec.path, {k: v for k, v in spec.knobs.items() if k != "cpus_exclusive"},
                                  spec.workload, spec.external)
            out.append(spec)
        return out

    def _check_partitions(self, report: ReconcileReport, specs: List[CgroupSpec]) -> None:
        """Read back each partition Tidal asked for: the kernel accepts the write and then may say
        ``root invalid (<reason>)``. Such a leaf goes back to ``member`` (a plain cpuset) and is reported."""
        for spec in specs:
            want = spec.knobs.get("partition")
            if want in (None, "member"):
                continue
            actual = (self.driver.read("", spec.path, "cpuset.cpus.partition") or "").strip()
            above = [p for p in self.partition_refused if spec.path.startswith(p + "/")]
            if actual.split(" ")[0] == want and "invalid" not in actual and not above:
                continue
            if not above:  # refused on a parent this pass: the leaf says nothing of its own
                reason = actual[actual.find("(") + 1:actual.rfind(")")] if "(" in actual else (actual or "unreadable")
                self._refuse(report, spec.path, f"the kernel made it {actual!r}: {reason}")
            try:
                self.driver.write("", spec.path, "cpuset.cpus.partition", "member")
                self.last[(spec.path, "", "cpuset.cpus.partition")] = "member"
            except CgroupError as exc:
                report.failed.append((spec.path, "cpuset.cpus.partition", str(exc)))

    def partition_of(self, path: str) -> Optional[str]:
        """What a dedicated leaf holds: the partition type, or why it is a plain cpuset."""
        for refused, reason in self.partition_refused.items():
            if path == refused or path.startswith(refused + "/"):
                return f"member ({refused}: {reason})"
        return self.last.get((path, "", "cpuset.cpus.partition"))

    def _find_drift(self, specs: List[CgroupSpec]) -> None:
        """Files that no longer hold what Tidal last wrote there: someone else changed them."""
        self._drifted: Dict[Key, Optional[str]] = {}
        version = self.driver.version
        for spec in specs:
            for knob, value in spec.knobs.items():
                for controller, file, _text in files_for(version, knob, value):
                    key = (spec.path, controller, file)
                    if key in self.last:
                        actual = self._read(controller, spec.path, file)
                        if actual is not None and not satisfied(file, actual, self.last[key]):
                            self._drifted[key] = actual.strip()

    def apply(self, specs: List[CgroupSpec], verify: bool = True) -> ReconcileReport:
        """Make the kernel match ``specs``. With ``verify=False`` the kernel is taken to hold what Tidal
        last wrote in its own tree: the same specs as the last applied ones read and write nothing, and
        changed ones write only what changed, reading only files Tidal has not written (others' cgroups,
        new ones). The caller verifies every so often: a verifying pass (and the first, and the one after
        a pass that failed) reads everything back, which is when drift made by others, processes missing
        from a hierarchy and controllers taken away are found and repaired."""
        present = getattr(self.driver, "present", self.driver.exists)
        specs = [spec for spec in specs if not spec.external or present(spec.path)]
        fingerprint = tuple((spec.path, tuple(sorted((k, repr(v)) for k, v in spec.knobs.items()))) for spec in specs)
        if not verify and fingerprint == self._applied:
            return ReconcileReport()
        self._trust_last = not verify and self._applied is not None
        try:
            report = self._apply(self._without_refused(specs))
        finally:
            self._trust_last = False
        self._forget_external({spec.path for spec in specs if spec.external})
        # a pending removal is tried again on the next pass, whatever the specs
        self._applied = fingerprint if report.ok and not report.pending else None
        return report

    def _forget_external(self, wanted: Set[str]) -> None:
        """Others' cgroups Tidal no longer writes (a pod that ended): drop what was kept of them."""
        for table in (self.last, self.originals):
            for key in [k for k in table if k[0] not in wanted and not self._ours(k[0])]:
                del table[key]

    def _apply(self, specs: List[CgroupSpec]) -> ReconcileReport:
        self._cache: Dict[Key, Optional[str]] = {}
        report = ReconcileReport()
        version = self.driver.version
        self._drifted = {}
        if not self._trust_last:
            self._find_drift(specs)
        # 1. remove what is no longer wanted (first: a parent's cpuset cannot
        #    narrow below a child that still exists)
        wanted = {spec.path for spec in specs}
        for root in self.managed_roots:
            for child in self.driver.children(root):
                path = f"{root}/{child}"
                if path not in wanted:
                    self._remove(report, path)
        refused = {path for path, _ in report.pending} | {path for path, _, _ in report.failed}
        for path in [p for p in self.refused_since if p not in refused]:
            del self.refused_since[path]  # gone by other hands, or wanted again: a later refusal starts afresh
        # 2. create, parents first (between verifying passes a cgroup Tidal wrote is taken to be there:
        #    one removed behind its back fails the write, and the pass after reads and makes it again)
        known = {key[0] for key in self.last} if self._trust_last else set()
        for spec in specs:
            if not spec.external and spec.path not in known and not self.driver.exists(spec.path):
                try:
                    self.driver.create(spec.path)
                    self.created.add(spec.path)
                    report.created.append(spec.path)
                except CgroupError as exc:
                    report.failed.append((spec.path, "", str(exc)))
        # v1: a process of one of Tidal's workloads that is missing from it in some hierarchy (a move
        #    cut short) joins it there too: membership is whole, in every hierarchy
        repair = getattr(self.driver, "repair_membership", None) if not self._trust_last else None
        if repair is not None:
            for spec in specs:
                if spec.workload is not None and not spec.external:
                    report.rejoined += [(spec.path, pid) for pid in repair(spec.path)]
        # v2: a controller taken away from one of Tidal's cgroups (its files vanish with it) is given back
        controllers = getattr(self.driver, "repair_controllers", None) if not self._trust_last else None
        if controllers is not None:
            checked: set = set()  # the parents looked at in this pass: its cgroups share a handful
            for spec in specs:
                if not spec.external and spec.path != self.base:
                    try:
                        report.reenabled += controllers(spec.path, checked)
                    except CgroupError as exc:
                        report.failed.append((spec.path, "cgroup.subtree_control", str(exc)))
        # 3. widen cpusets top-down, 4. narrow bottom-up
        for spec in specs:
            for knob in CPUSET_KNOBS:
                if knob in spec.knobs:
                    for controller, file, text in files_for(version, knob, spec.knobs[knob]):
                        actual = self._read(controller, spec.path, file)
                        if actual is not None and actual.strip() == text:
                            continue  # holds it already: nothing to widen
                        wide = _union(actual, text)
                        if normalize(file, actual) != wide:
                            self._write(report, spec.path, controller, file, wide, final=False)
        for spec in reversed(specs):
            for knob in CPUSET_KNOBS:
                if knob in spec.knobs:
                    for controller, file, text in files_for(version, knob, spec.knobs[knob]):
                        self._write(report, spec.path, controller, file, text)
        # 5. quotas like cpusets: v1 refuses a parent quota below a child's
        #    (EINVAL), so raise top-down first, then lower bottom-up. A burst may not exceed its quota
        #    (EINVAL on either file): one that shrinks is written first, one that grows with the others (6.)
        for spec in specs:
            if "cpu_burst" in spec.knobs:
                for controller, file, text in files_for(version, "cpu_burst", spec.knobs["cpu_burst"]):
                    actual = self._read(controller, spec.path, file)
                    if actual is not None and actual.strip().isdigit() and int(actual) > int(text):
                        self._write(report, spec.path, controller, file, text, final=False)
        for spec in specs:
            if "cpu_max" in spec.knobs:
                quota, period = spec.knobs["cpu_max"]
                current = self._quota(spec.path)
                if current is not None and (quota is None or (current != -1 and current < quota)):
                    for controller, file, text in files_for(version, "cpu_max", (quota, period)):
                        self._write(report, spec.path, controller, file, text, final=False)
        for spec in reversed(specs):
            if "cpu_max" in spec.knobs:
                for controller, file, text in files_for(version, "cpu_max", spec.knobs["cpu_max"]):
                    self._write(report, spec.path, controller, file, text)
        # 6. the other knobs
        for spec in specs:
            for knob, value in spec.knobs.items():
                if knob in CPUSET_KNOBS or knob == "cpu_max":
                    continue
                if knob == "cpu_idle" and not self.driver.features.get("cpu.idle"):
                    continue
                for controller, file, text in files_for(version, knob, value):
                    self._write(report, spec.path, controller, file, text)
        self._check_partitions(report, specs)
        # values systemd could not take before (its bus was away): asked again while still wanted
        for (path, file), text in list(self._to_hold.items()):
            if self.last.get((path, "", file)) == text and path in wanted:
                self._hold(report, path, file, text)
            elif path not in wanted:
                del self._to_hold[(path, file)]
        return report

    def _quota(self, path: str) -> Optional[int]:
        """Current quota in microseconds (-1: none), ``None`` if unreadable."""
        if self.driver.version == 1:
            text = self._read("cpu", path, "cpu.cfs_quota_us")
            try:
                return int(text) if text is not None else None
            except ValueError:
                return None
        parts = (self._read("", path, "cpu.max") or "").split()
        if not parts:
            return None
        return -1 if parts[0] == "max" else int(parts[0])

    def _remove(self, report: ReconcileReport, path: str) -> None:
        for child in self.driver.children(path):
            self._remove(report, f"{path}/{child}")
        anywhere = getattr(self.driver, "procs_anywhere", self.driver.procs)
        # back where they would be without Tidal: the parent it was given, or (v2, a non-root parent,
        # which may hold no processes once it distributes controllers) the agent's own leaf
        target = getattr(self.driver, "evacuation", lambda base: "")(self.base)
        if target and (path == target or target.startswith(path + "/")):
            target = ""
        for pid in anywhere(path):  # in any hierarchy: one left in cpu or memory keeps that twin alive
            try:
                self.driver.move(target, pid)
            except CgroupError:
                pass  # the process exited meanwhile
        try:
            self.driver.remove(path)
            report.removed.append(path)
            self.refused_since.pop(path, None)
            self.created.discard(path)
            self.partition_refused.pop(path, None)
            for key in [k for k in self.last if k[0] == path]:
                del self.last[key]
        except CgroupError as exc:
            since = self.refused_since.setdefault(path, self.clock())
            if self.clock() - since < REMOVAL_GRACE_S:
                report.pending.append((path, str(exc)))
            else:
                report.failed.append((path, "", f"{exc} (for {self.clock() - since:.0f} s)"))

    def revert(self) -> ReconcileReport:
        """Put back what was found: no Tidal tree, and original values of others' cgroups (after the
        tree is gone: v2 leaves cpus that Tidal's tree held exclusively out of others' effective sets
        until then)."""
        report = ReconcileReport()
        # not only if it exists everywhere: a tree half made or half removed is removed too
        unprepare = getattr(self.driver, "unprepare", None)
        gone = False
        if unprepare is not None and self.driver.exists(self.base):
            # v2 under a non-root parent: the agent's leaf goes last, with the parent's controllers
            for child in self.driver.children(self.base):
                if child != "system":
                    self._remove(report, f"{self.base}/{child}")
            try:
                if unprepare(self.base):
                    gone = True
                    report.removed.append(self.base)
                    self.created.discard(self.base)
            except CgroupError as exc:
                report.failed.append((self.base, "", str(exc)))
        if not gone:
            self._remove(report, self.base)
        # sorted: a parent before its children, so an "as the parent" original below reads it restored
        properties: Dict[str, List[Tuple[str, int]]] = {}
        for (path, controller, file), original in sorted(self.originals.items()):
            if controller == SYSTEMD:  # a unit's property: given back after its files (below)
                try:
                    properties.setdefault(path, []).append((file, int(original or "")))
                except ValueError:
                    report.failed.append((path, SYSTEMD, f"{file}: a saved value {original!r} is no number"))
                continue
            if original is None:
                continue
            text = original.strip()
            try:
                if not text and file in ("cpuset.cpus", "cpuset.mems"):
                    text = self._restore_inherited(controller, path, file)
                else:
                    self._put(controller, path, file, self.driver.read(controller, path, file), text)
                report.written.append((path, file, text))
            except CgroupError as exc:
                report.failed.append((path, file, str(exc)))
        for path, values in properties.items():
            if self.units is None or not self.driver.exists(path):
                continue  # the unit is gone (its pod ended), or this agent cannot reach systemd: nothing to give back
            try:
                self.units.restore(path.rsplit("/", 1)[-1], values)
                report.held += [(path, name, str(value)) for name, value in values]
            except SystemdError as exc:
                report.failed.append((path, SYSTEMD, str(exc)))
        self._to_hold.clear()
        # the tree goes now or not at all: a removal the kernel refuses here is a failure, said as one
        report.failed.extend((path, "", reason) for path, reason in report.pending)
        report.pending = []
        self.last.clear()
        self._applied = None
        return report

    def _restore_inherited(self, controller: str, path: str, file: str) -> str:
        """Give back an empty ("as the parent") cpuset. The kernel refuses empty while the cgroup has
        tasks (ENOSPC); then it gets the parent's effective set, which is what empty would give them."""
        try:
            self.driver.write(controller, path, file, "")
            return ""
        except CgroupError:
            parent = path.rsplit("/", 1)[0] if "/" in path else ""
            inherited = (self.driver.read(controller, parent, file + ".effective") or "").strip()
            if not inherited:
                raise
            self.driver.write(controller, path, file, inherited)
            return inherited

    def export(self) -> Dict[str, object]:
        """What a restarted agent needs to revert later (kept beside the checkpoint)."""
        return {"originals": [[p, c, f, v] for (p, c, f), v in sorted(self.originals.items())]}

    def adopt(self, data: Dict[str, object]) -> None:
        for p, c, f, v in data.get("originals", []):
            self.originals.setdefault((p, c, f), v)

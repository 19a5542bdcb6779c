"""The side-effect boundary of cgroup isolation: a small protocol and the kernel's driver.

``CgroupDriver`` is what the reconciler needs from the kernel. ``KernelCgroups``
is the real one (files under the cgroup mounts); ``recording.RecordingCgroups``
keeps everything in memory and records each operation (dry runs, and the unit
tests of the layers above).

Paths are logical (``"tidal/dedicated/web"``), relative to a parent cgroup
per hierarchy: ``/`` by default, or the agent's own cgroup (``parent="self"``)
when it runs delegated (systemd ``Delegate=yes``) or inside a test sandbox.
"""

from __future__ import annotations

import errno
import os
from typing import Dict, List, Optional, Protocol, Set, Tuple

from agent.isolation.cgroups.detect import CgroupError, CgroupMounts
from agent.topology.hostfs import HostFS

# v1 cpuset files whose value must stay within the parent's (children first when narrowing)
NESTED_CPUSET_FILES = ("cpuset.cpus", "cpuset.mems")


class CgroupDriver(Protocol):
    version: int
    features: Dict[str, bool]

    def exists(self, path: str) -> bool: ...
    def present(self, path: str) -> bool: ...
    def create(self, path: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def read(self, controller: str, path: str, file: str) -> Optional[str]: ...
    def write(self, controller: str, path: str, file: str, text: str) -> None: ...
    def procs(self, path: str) -> List[int]: ...
    def move(self, path: str, pid: int) -> None: ...
    def children(self, path: str) -> List[str]: ...
    def cpu_usage_ns(self, path: str) -> Optional[int]: ...
    def memory_usage_bytes(self, path: str) -> Optional[int]: ...
    def memory_working_set_bytes(self, path: str) -> Optional[int]: ...
    def usage_reader(self, path: str): ...
    def percpu_reader(self, path: str): ...
    def kill(self, path: str, sig: int) -> List[int]: ...
    def where(self, path: str) -> Dict[str, str]: ...
    def prepare(self, base: str) -> List[int]: ...
    def pressure(self, path: str, resource: str) -> Optional[Dict[str, Dict[str, float]]]: ...
    def memory_ceiling(self) -> Optional[Tuple[int, int]]: ...


def own_cgroups(fs: HostFS, pid: str = "self") -> Dict[str, str]:
    """``{controller: path}`` of a process, from ``/proc/<pid>/cgroup`` ("" is the v2 path)."""
    result: Dict[str, str] = {}
    for line in (fs.read(f"/proc/{pid}/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            result[controller] = parts[2]
    return result


UNLIMITED_BYTES = 1 << 60  # v1 writes "no limit" as the page counter's maximum (9223372036854771712)
UNIFIED = "unified"  # key of the hybrid host's membership-only cgroup2 tree in KernelCgroups.bases


class KernelCgroups:
    """Real cgroup files (v1: one directory per hierarchy; v2: one tree)."""

    def __init__(self, mounts: CgroupMounts, fs: Optional[HostFS] = None, parent: str = "/",
                 mirror_unified: bool = True) -> None:
        self.mounts = mounts
        self.version = mounts.version
        self.features = dict(mounts.features)
        self.fs = fs or HostFS("/")
        own = own_cgroups(self.fs) if parent == "self" else {}
        if self.version == 2:
            self.controllers = [""]
        else:
            self.controllers = [c for c in ("cpuset", "cpu", "cpuacct", "memory") if c in mounts.mounts]
        self.bases: Dict[str, str] = {}
        for controller in self.controllers:
            base = own.get(controller, own.get("", "/")) if parent == "self" else parent
            self.bases[controller] = self.fs.path(mounts.mount_of(controller or "cpu")) + base.rstrip("/")
        # v1 hierarchies may be co-mounted (cpu,cpuacct): create each directory once
        seen = {}
        for controller in self.controllers:
            seen.setdefault(self.bases[controller], controller)
        self._distinct = list(seen.values())
        # Hybrid hosts: mirror the tree in the controller-less cgroup2 hierarchy. A socket
        # belongs to the cgroup2 cgroup of the task that made it, and that is what the
        # network classifier matches (nft ``socket cgroupv2``); v1 membership is invisible to it.
        if self.version == 1 and mirror_unified and mounts.unified:
            base = own.get("", "/") if parent == "self" else parent
            self.bases[UNIFIED] = self.fs.path(mounts.unified) + base.rstrip("/")
            self._distinct.append(UNIFIED)

    def _dir(self, controller: str, path: str) -> str:
        key = "" if self.version == 2 else controller
        return f"{self.bases[key]}/{path}".rstrip("/")

    def where(self, path: str) -> Dict[str, str]:
        return {c or "unified": self._dir(c, path) for c in self.controllers}

    def below(self, path: str) -> "KernelCgroups":
        """The same hierarchies with ``path``, a cgroup under this driver's parent, as the parent in each
        (where the parent is each hierarchy's own cgroup of this process, they differ: one path would not
        do). ``bench memory-isolation`` puts Tidal's tree in its box this way, as at a node's root."""
        other = KernelCgroups.__new__(KernelCgroups)
        other.__dict__.update(self.__dict__)
        other.features = dict(self.features)
        other.bases = {controller: f"{base}/{path.strip('/')}" for controller, base in self.bases.items()}
        return other

    def root_view(self) -> "KernelCgroups":
        """The same hierarchies seen from their roots: for reading cgroups outside Tidal's tree
        (``--offline-cgroup``), whatever the tree's parent."""
        return KernelCgroups(self.mounts, self.fs, parent="/", mirror_unified=False)

    def prepare(self, base: str) -> List[int]:
        """Check, before anything is made, that Tidal's tree can live under its parent, and on v2 keep
        the "no internal processes" rule: a non-root cgroup that enables controllers for its children
        holds no processes. When the parent is such a cgroup with processes of its own (the agent's,
        under systemd with ``Delegate=yes`` and ``--cgroup-parent self``), they move into the leaf
        ``<base>/system`` first, as systemd's ``DelegateSubgroup=`` would. Returns the pids moved.
        Raises ``CgroupError`` with one line saying what is missing and what to do; nothing is made then."""
        if self.version != 2:
            return []
        parent = self.bases[""]
        root = self.fs.path(self.mounts.mounts[""]).rstrip("/")
        try:
            with open(os.path.join(parent, "cgroup.controllers")) as handle:
                controllers = set(handle.read().split())
        except OSError as exc:
            raise CgroupError(f"{parent}: not a cgroup Tidal can use ({exc.strerror})") from None
        missing = [c for c in ("cpuset", "cpu") if c not in controllers]
        if missing:
            raise CgroupError(f"{parent}: the {' and '.join(missing)} controller{'s are' if len(missing) > 1 else ' is'} "
                              f"not available (its parent does not enable {'them' if len(missing) > 1 else 'it'} in "
                              f"cgroup.subtree_control); delegate {'them' if len(missing) > 1 else 'it'} to this "
                              f"cgroup or use --cgroup-parent /")
        moved = self._settle(base) if self.holds_no_processes() else []
        if self.fs.is_live:
            self._probe_features(base)
        return moved

    def _probe_features(self, base: str) -> None:
        """What this kernel offers, read in Tidal's own top cgroup with the controllers enabled (the root
        cgroup has no cpu.idle, cpuset.cpus.exclusive or memory.max of its own, and a fresh hierarchy may
        have no other cgroup to look at)."""
        self.create(base)
        directory = self._dir("", base)
        for feature, file in (("cpu.idle", "cpu.idle"), ("cpu.burst", "cpu.max.burst"), ("memory", "memory.max"),
                              ("psi", "cpu.pressure"),
                              ("partition", "cpuset.cpus.exclusive"), ("io", "io.max")):
            self.features[feature] = os.path.exists(os.path.join(directory, file))

    def _settle(self, base: str) -> List[int]:
        parent = self.bases[""]
        unit = os.path.basename(parent)
        if unit.endswith((".service", ".scope")) and not _delegated(parent):
            raise CgroupError(f"{parent}: a systemd unit's cgroup that is not delegated (systemd would take back "
                              f"the controllers Tidal enables there): set Delegate=yes in the unit, or use "
                              f"--cgroup-parent /")
        try:
            with open(os.path.join(parent, "cgroup.procs")) as handle:
                pids = [int(p) for p in handle.read().split()]
        except OSError as exc:
            raise CgroupError(f"{parent}/cgroup.procs: unreadable: {exc.strerror}") from None
        if not pids:
            return []
        leaf = f"{base}/system"
        for path in (base, leaf):
            try:
                os.mkdir(self._dir("", path))
            except FileExistsError:
                pass
            except OSError as exc:
                raise CgroupError(f"{self._dir('', path)}: cannot create cgroup: {exc.strerror}") from None
        moved = []
        for pid in pids:
            try:
                self._write_procs(self._dir("", leaf), pid)
                moved.append(pid)
            except ProcessLookupError:
                pass  # exited meanwhile
        return moved

    def holds_no_processes(self) -> bool:
        """v2 with a parent that is not the root cgroup: the parent may not hold processes once it enables
        controllers, so a process leaving a workload goes to ``<base>/system``, not to the parent."""
        if self.version != 2 or not self.fs.is_live:
            return False
        return self.bases[""] != self.fs.path(self.mounts.mounts[""]).rstrip("/")

    def evacuation(self, base: str) -> str:
        """Where the leftover processes of a removed cgroup go: the parent Tidal was given, or on v2 under a
        non-root parent (which may not hold processes) the agent's own leaf ``<base>/system``."""
        return f"{base}/system" if self.holds_no_processes() else ""

    def unprepare(self, base: str) -> bool:
        """Undo ``prepare`` on revert: with every other cgroup of the tree gone, stop distributing
        controllers from ``<base>`` and the parent (v2 allows processes in a cgroup only then), move
        ``<base>/system``'s processes back to the parent and remove both. False when there is nothing
        of the kind to do (v1, the root cgroup as parent): the caller removes the tree as usual."""
        if not self.holds_no_processes() or not os.path.isdir(self._dir("", base)):
            return False
        others = [c for c in self.children(base) if c != "system"]
        siblings = [c for c in self.children("") if c != base.split("/")[0]]
        if others or siblings:
            return False  # the parent still distributes to cgroups that are not Tidal's: leave it as it is
        for path in (base, ""):
            control = os.path.join(self._dir("", path), "cgroup.subtree_control")
            try:
                with open(control) as handle:
                    enabled = handle.read().split()
                for controller in reversed(enabled):
                    with open(control, "w") as handle:
                        handle.write(f"-{controller}")
            except OSError as exc:
                raise CgroupError(f"{control}: cannot stop distributing controllers: {exc.strerror}") from None
        for pid in self.procs(f"{base}/system"):
            try:
                self._write_procs(self.bases[""], pid)
            except ProcessLookupError:
                pass
        for path in (f"{base}/system", base):
            try:
                os.rmdir(self._dir("", path))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise CgroupError(f"{self._dir('', path)}: cannot remove cgroup: {exc.strerror}") from None
        return True

    @staticmethod
    def _write_procs(directory: str, pid: int) -> None:
        try:
            with open(os.path.join(directory, "cgroup.procs"), "w") as handle:
                handle.write(str(pid))
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise ProcessLookupError(pid) from None
            raise CgroupError(f"{directory}/cgroup.procs: cannot move pid {pid}: {exc.strerror}") from None

    def membership_dir(self, path: str) -> Optional[str]:
        """The cgroup2 directory whose members are the workload's tasks (v2: the cgroup
        itself; hybrid v1: its mirror), or ``None`` when the host has no cgroup2 tree."""
        if self.version == 2:
            return self._dir("", path)
        return self._dir(UNIFIED, path) if UNIFIED in self.bases else None

    def exists(self, path: str) -> bool:
        return all(os.path.isdir(self._dir(c, path)) for c in self._distinct)

    def present(self, path: str) -> bool:
        """A cgroup someone else made (the kubelet's) exists where its cpuset is: v1's cpuset
        hierarchy, v2's tree (others do not mirror their cgroups in the hybrid cgroup2 tree)."""
        controller = "" if self.version == 2 else ("cpuset" if "cpuset" in self.bases else self._distinct[0])
        return os.path.isdir(self._dir(controller, path))

    def create(self, path: str) -> None:
        for controller in self._distinct:
            directory = self._dir(controller, path)
            if self.version == 2:
                self._enable_controllers(path)
            try:
                os.mkdir(directory)
            except FileExistsError:
                pass
            except OSError as exc:
                raise CgroupError(f"{directory}: cannot create cgroup: {exc.strerror}") from None

    def repair_controllers(self, path: str, checked: Optional[Set[str]] = None) -> List[str]:
        """v2: controllers someone took away from a cgroup of Tidal's (``-cpuset`` in its parent's
        ``cgroup.subtree_control`` removes its cpuset files, and with them its confinement) are given back;
        the ``parent:controller`` pairs re-enabled. v1 has nothing of the kind. ``checked``: the parents
        one pass has looked at already (its cgroups share them: 200 workloads under three trees have a
        handful of parents, not 600), skipped, and the ones looked at here added."""
        if self.version != 2 or not os.path.isdir(self._dir("", path)):
            return []
        return self._enable_controllers(path, checked)

    def pressure(self, path: str, resource: str) -> Optional[Dict[str, Dict[str, float]]]:
        """PSI of a cgroup (``cpu``, ``memory``, ``io``): ``{"some": {"avg10": .., "avg60": .., "avg300": ..,
        "total": ..}, "full": {...}}``, or ``None`` where the kernel keeps none. On a hybrid v1 host the
        figures come from the cgroup2 mirror, whose members are the same tasks."""
        directory = self.membership_dir(path)
        if directory is None:
            return None
        try:
            text = _slurp(os.path.join(directory, f"{resource}.pressure"))
        except OSError:
            return None
        return parse_pressure(text)

    def _enable_controllers(self, path: str, checked: Optional[Set[str]] = None) -> List[str]:
        """v2: a child gets cpu/cpuset/memory/io files only if its parent delegates them (io where the
        kernel offers it: the io throttle's ``io.max``, and ``io.stat``). Parents in ``checked`` are
        skipped; those looked at are added to it."""
        enabled_now = []
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts)):
            parent = self._dir("", "/".join(parts[:depth]))
            if checked is not None:
                if parent in checked:
                    continue
                checked.add(parent)
            control = os.path.join(parent, "cgroup.subtree_control")
            try:
                enabled = set(_slurp(control).split())
            except OSError:
                continue
            try:
                available = set(_slurp(os.path.join(parent, "cgroup.controllers")).split())
            except OSError:
                available = {"cpu", "cpuset", "memory"}
            for controller in ("cpuset", "cpu", "memory", "io"):
                if controller in available and controller not in enabled:
                    try:
                        with open(control, "w") as handle:
                            handle.write(f"+{controller}")
                        enabled_now.append(f"{parent}:{controller}")
                    except OSError as exc:
                        raise CgroupError(f"{control}: cannot enable {controller}: {exc.strerror}") from None
        return enabled_now

    def remove(self, path: str) -> None:
        """Remove the cgroup in every hierarchy (and the cgroup2 mirror): each is tried, and any
        that stays is reported, never only the first."""
        failed = []
        for controller in self._distinct:
            directory = self._dir(controller, path)
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append(f"{directory}: {exc.strerror}")
        if failed:
            raise CgroupError(f"cannot remove cgroup {path}: {'; '.join(failed)}")

    def read(self, controller: str, path: str, file: str) -> Optional[str]:
        try:
            return _slurp(os.path.join(self._dir(controller, path), file))
        except OSError:
            return None

    def write(self, controller: str, path: str, file: str, text: str) -> None:
        target = os.path.join(self._dir(controller, path), file)
        try:
            self._write_file(target, text)
        except OSError as exc:
            if not (exc.errno == errno.EBUSY and self.version == 1 and file in NESTED_CPUSET_FILES):
                raise CgroupError(f"{target}: write {text!r} refused: {exc.strerror}") from None
            # v1 refuses to narrow a cpuset that a child's reaches past (cpuset(7): EBUSY); a
            # kubelet pod's cgroup has children Tidal is not told of (the sandbox's, a container
            # starting). They are narrowed first, to what they keep of the new set, then the parent.
            self._narrow_children(controller, path, file, text)
            try:
                self._write_file(target, text)
            except OSError as again:
                raise CgroupError(f"{target}: write {text!r} refused: {again.strerror}") from None

    def _write_file(self, target: str, text: str) -> None:
        fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT if self._fake_tree() else 0), 0o644)
        try:
            os.write(fd, text.encode() if text else b"\n")
        finally:
            os.close(fd)

    def _narrow_children(self, controller: str, path: str, file: str, text: str) -> None:
        from agent.topology.parse import format_cpulist, parse_cpulist

        wanted = set(parse_cpulist(text.strip()))
        directory = self._dir(controller, path)
        try:
            names = sorted(e for e in os.listdir(directory) if os.path.isdir(os.path.join(directory, e)))
        except OSError:
            return
        for name in names:
            child = f"{path.rstrip('/')}/{name}"
            held = self.read(controller, child, file)
            if held is None:
                continue
            have = set(parse_cpulist(held.strip())) if held.strip() else set()
            if have <= wanted:
                continue
            self.write(controller, child, file, format_cpulist(sorted(have & wanted) or sorted(wanted)))

    def _fake_tree(self) -> bool:
        """Captured or fake trees (tests of v2 on this v1 machine) are plain files: create them."""
        return not self.fs.is_live

    def procs(self, path: str) -> List[int]:
        controller = "" if self.version == 2 else "cpuset"
        text = self.read(controller, path, "cgroup.procs") or ""
        return [int(p) for p in text.split()]

    def procs_anywhere(self, path: str) -> List[int]:
        """Processes in the cgroup in any hierarchy (v1 membership is per hierarchy: a process
        moved out of one by someone else is still in the others)."""
        pids = set()
        for controller in self._distinct:
            try:
                pids.update(int(p) for p in _slurp(os.path.join(self._dir(controller, path), "cgroup.procs")).split())
            except OSError:
                pass
        return sorted(pids)

    def repair_membership(self, path: str) -> List[int]:
        """v1: processes of the cgroup that are missing from it in some hierarchy (a move cut short,
        e.g. by a SIGKILL of the agent between two hierarchies) are moved there too; the pids fixed."""
        if len(self._distinct) < 2:
            return []
        members = {}
        for controller in self._distinct:
            try:
                members[controller] = {int(p) for p in _slurp(os.path.join(self._dir(controller, path),
                                                                           "cgroup.procs")).split()}
            except OSError:
                return []  # not there in every hierarchy: creation repairs that first
        every = set().union(*members.values())
        fixed = []
        for pid in sorted(every):
            missing = [c for c, pids in members.items() if pid not in pids]
            for controller in missing:
                try:
                    with open(os.path.join(self._dir(controller, path), "cgroup.procs"), "w") as handle:
                        handle.write(str(pid))
                except OSError:
                    break  # exited meanwhile
            else:
                if missing:
                    fixed.append(pid)
        return fixed

    def accounting_controllers(self) -> List[str]:
        """Where an offline system's own cgroup (``--offline-cgroup``) lives: v2's one tree; on v1 the
        accounting hierarchies only (cpu/cpuacct and memory), never cpuset, whose new children start
        with no cpus (a process there could run nowhere)."""
        if self.version == 2:
            return [""]
        return [c for c in self._distinct if c in ("cpu", "cpuacct", "memory")]

    def join_offline(self, path: str, pid: int) -> None:
        """Put ``pid`` in the offline cgroup ``path`` (from the hierarchies' roots, see ``root_view``),
        making it where it is missing; only where accounting is kept (``accounting_controllers``)."""
        for controller in self.accounting_controllers():
            directory = self._dir(controller, path)
            try:
                os.makedirs(directory, exist_ok=True)
                with open(os.path.join(directory, "cgroup.procs"), "w") as handle:
                    handle.write(str(pid))
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    raise CgroupError(f"pid {pid}: no such process") from None
                raise CgroupError(f"{directory}: cannot move pid {pid}: {exc.strerror}") from None

    def move(self, path: str, pid: int) -> None:
        for controller in self._distinct:
            target = os.path.join(self._dir(controller, path), "cgroup.procs")
            try:
                with open(target, "w") as handle:
                    handle.write(str(pid))
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    raise CgroupError(f"pid {pid}: no such process") from None
                raise CgroupError(f"{target}: cannot move pid {pid}: {exc.strerror}") from None

    def children(self, path: str) -> List[str]:
        """Child cgroups in any hierarchy: a leftover in one (its twin gone from another) is still found."""
        names = set()
        for controller in self._distinct:
            directory = self._dir(controller, path)
            try:  # the entries' types from the directory itself: no stat of each of its files
                with os.scandir(directory) as entries:
                    names.update(e.name for e in entries if e.is_dir(follow_symlinks=False))
            except OSError:
                pass
        return sorted(names)

    def memory_usage_bytes(self, path: str) -> Optional[int]:
        if self.version == 1:
            text = self.read("memory", path, "memory.usage_in_bytes") if "memory" in self.bases else None
        else:
            text = self.read("", path, "memory.current")
        return int(text) if text and text.strip().isdigit() else None

    def memory_working_set_bytes(self, path: str) -> Optional[int]:
        """What the cgroup holds less its inactive page cache (the kubelet's "working set", what
        ``kubectl top`` shows); ``None`` when the cgroup or its memory controller is not there."""
        used = self.memory_usage_bytes(path)
        if used is None:
            return None
        text = self.read("memory" if self.version == 1 else "", path, "memory.stat") or ""
        name = "total_inactive_file" if self.version == 1 else "inactive_file"
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.strip().isdigit():
                return max(0, used - int(value))
        return used

    def memory_ceiling(self) -> Optional[Tuple[int, int]]:
        """The tightest memory limit on the parent Tidal was given and its ancestors, as ``(limit,
        available)`` bytes, where available is that limit less what the limited cgroup holds, its
        inactive page cache counted free (as ``MemAvailable`` counts it); ``None`` when nothing above
        Tidal's tree limits memory (the machine's memory is the node's). A parent with a limit (a
        delegated systemd slice with ``MemoryMax=``, a container) bounds what Tidal can lend."""
        key = "" if self.version == 2 else "memory"
        if key not in self.bases:
            return None
        root = self.fs.path(self.mounts.mount_of(key or "cpu")).rstrip("/")
        names = ("memory.max", "memory.current", "inactive_file") if self.version == 2 else \
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        ceiling: Optional[Tuple[int, int]] = None
        directory = self.bases[key].rstrip("/")
        while len(directory) > len(root):
            limit = _read_int(os.path.join(directory, names[0]))
            if limit is not None and limit < UNLIMITED_BYTES:
                used = _read_int(os.path.join(directory, names[1])) or 0
                inactive = _stat_field(os.path.join(directory, "memory.stat"), names[2]) or 0
                available = max(0, limit - max(0, used - inactive))
                ceiling = (limit, available) if ceiling is None else (min(ceiling[0], limit), min(ceiling[1], available))
            directory = os.path.dirname(directory)
        return ceiling

    def kill(self, path: str, sig: int) -> List[int]:
        """Signal every process of the cgroup and its descendants; returns the pids signalled."""
        signalled = []
        for pid in procs_in_tree(self, path):
            try:
                os.kill(pid, sig)
                signalled.append(pid)
            except ProcessLookupError:
                pass
        return signalled

    def file_reader(self, controller: str, path: str, file: str):
        """A function returning a cgroup file's text, read through a file kept open:
        opening a cgroup file costs ~10x a pread of it, and the agent reads a few
        of them every period and the fast guard 20 times a second. A cgroup
        removed (and maybe made again) is reopened once; gone, it reads ``None``. Its ``close()``
        closes the file (the next read opens it again)."""
        target = os.path.join(self._dir(controller, path), file)
        state = {"fd": None}

        def close() -> None:
            if state["fd"] is not None:
                os.close(state["fd"])
                state["fd"] = None

        def read() -> Optional[str]:
            for _ in range(2):
                if state["fd"] is None:
                    try:
                        state["fd"] = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
                    except OSError:
                        return None
                try:
                    return os.pread(state["fd"], 65536, 0).decode()
                except OSError:
                    close()
            return None

        read.close = close  # type: ignore[attr-defined]
        return read

    def usage_reader(self, path: str):
        """A function returning the cgroup's cumulative cpu ns (see ``file_reader``; ``close()`` too)."""
        if self.version == 1:
            if "cpuacct" not in self.bases:
                def nothing() -> Optional[int]:
                    return None

                nothing.close = lambda: None  # type: ignore[attr-defined]
                return nothing
            read = self.file_reader("cpuacct", path, "cpuacct.usage")

            def usage_v1() -> Optional[int]:
                return _int_or_none(read())

            usage_v1.close = read.close  # type: ignore[attr-defined]
            return usage_v1
        read = self.file_reader("", path, "cpu.stat")

        def usage() -> Optional[int]:
            for line in (read() or "").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) * 1000
            return None

        usage.close = read.close  # type: ignore[attr-defined]
        return usage

    def percpu_reader(self, path: str):
        """A function returning cumulative ns per cpu (v1 ``cpuacct.usage_percpu``), or ``None``."""
        if self.version != 1 or "cpuacct" not in self.bases:
            return lambda: None
        read = self.file_reader("cpuacct", path, "cpuacct.usage_percpu")

        def percpu() -> Optional[List[int]]:
            text = read()
            try:
                return [int(v) for v in text.split()] if text else None
            except ValueError:
                return None

        return percpu

    def cpu_usage_ns(self, path: str) -> Optional[int]:
        if self.version == 1:
            text = self.read("cpuacct", path, "cpuacct.usage") if "cpuacct" in self.bases else None
            return int(text) if text and text.strip().isdigit() else None
        for line in (self.read("", path, "cpu.stat") or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) * 1000
        return None


def parse_pressure(text: str) -> Optional[Dict[str, Dict[str, float]]]:
    """A PSI file (``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` and a ``full`` line)."""
    result: Dict[str, Dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        try:
            result[kind] = {k: float(v) for k, v in (field.split("=", 1) for field in rest.split())}
        except ValueError:
            return None
    return result or None


def _delegated(directory: str) -> bool:
    """systemd marks a cgroup it delegated with the ``trusted.delegate`` xattr (``user.delegate`` in a user manager)."""
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(directory, name).strip(b"\0") in (b"1", b"yes", b"true"):
                return True
        except OSError:
            pass
    return False


def _slurp(path: str) -> str:
    """A cgroup file's text: open, read, close (three system calls; ``open()``'s buffered text wrapper
    adds an fstat, an ioctl and an lseek to each, and the agent reads hundreds of files a second)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def _int_or_none(text: Optional[str]) -> Optional[int]:
    return int(text) if text and text.strip().isdigit() else None


def _read_int(path: str) -> Optional[int]:
    """A cgroup file holding one number; ``None`` when absent, unreadable or not a number (v2's ``max``)."""
    try:
        return _int_or_none(_slurp(path))
    except OSError:
        return None


def _stat_field(path: str, name: str) -> Optional[int]:
    """One field of a flat-keyed cgroup file (``memory.stat``)."""
    try:
        text = _slurp(path)
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return _int_or_none(value)
    return None


USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # cpuacct.stat's unit


def cpu_times_ns(driver, path: str) -> Optional[Tuple[int, int]]:
    """A cgroup's cumulative (user, system) cpu time in nanoseconds, descendants included: v1
    ``cpuacct.stat`` (in ``USER_HZ`` ticks), v2 ``cpu.stat`` (microseconds); ``None`` where unreadable."""
    if driver.version == 1:
        text, unit, keys = driver.read("cpuacct", path, "cpuacct.stat"), 1_000_000_000 // USER_HZ, ("user", "system")
    else:
        text, unit, keys = driver.read("", path, "cpu.stat"), 1000, ("user_usec", "system_usec")
    fields = dict(line.split(None, 1) for line in (text or "").splitlines() if len(line.split()) == 2)
    try:
        return int(fields[keys[0]]) * unit, int(fields[keys[1]]) * unit
    except (KeyError, ValueError):
        return None


def procs_in_tree(driver, path: str) -> List[int]:
    """Processes of a cgroup and its descendants."""
    pids = list(driver.procs(path))
    for child in driver.children(path):
        pids.extend(procs_in_tree(driver, f"{path}/{child}"))
    return pids

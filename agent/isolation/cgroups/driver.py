"""The side-effect boundary of cgroup isolation: a small protocol and two drivers.

``CgroupDriver`` is what the reconciler needs from the kernel. ``KernelCgroups``
is the real one (files under the cgroup mounts); ``RecordingCgroups`` keeps
everything in memory and records each operation, for the unit tests of the
layers above and for end-to-end tests that must not touch the host.

Paths are logical (``"tidal/dedicated/web"``), relative to a parent cgroup
per hierarchy: ``/`` by default, or the agent's own cgroup (``parent="self"``)
when it runs delegated (systemd ``Delegate=yes``) or inside a test sandbox.
"""

from __future__ import annotations

import errno
import os
from typing import Dict, List, Optional, Protocol, Tuple

from agent.isolation.cgroups.detect import CgroupError, CgroupMounts
from agent.topology.hostfs import HostFS


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
    def usage_reader(self, path: str): ...
    def percpu_reader(self, path: str): ...
    def kill(self, path: str, sig: int) -> List[int]: ...
    def where(self, path: str) -> Dict[str, str]: ...


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

    def _enable_controllers(self, path: str) -> None:
        """v2: a child gets cpu/cpuset/memory files only if its parent delegates them."""
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts)):
            parent = self._dir("", "/".join(parts[:depth]))
            control = os.path.join(parent, "cgroup.subtree_control")
            try:
                with open(control) as handle:
                    enabled = set(handle.read().split())
            except OSError:
                continue
            try:
                with open(os.path.join(parent, "cgroup.controllers")) as handle:
                    available = set(handle.read().split())
            except OSError:
                available = {"cpu", "cpuset", "memory"}
            for controller in ("cpuset", "cpu", "memory"):
                if controller in available and controller not in enabled:
                    try:
                        with open(control, "w") as handle:
                            handle.write(f"+{controller}")
                    except OSError as exc:
                        raise CgroupError(f"{control}: cannot enable {controller}: {exc.strerror}") from None

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
            with open(os.path.join(self._dir(controller, path), file)) as handle:
                return handle.read()
        except OSError:
            return None

    def write(self, controller: str, path: str, file: str, text: str) -> None:
        target = os.path.join(self._dir(controller, path), file)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CLOEXEC | (os.O_CREAT if self._fake_tree() else 0), 0o644)
            try:
                os.write(fd, text.encode() if text else b"\n")
            finally:
                os.close(fd)
        except OSError as exc:
            raise CgroupError(f"{target}: write {text!r} refused: {exc.strerror}") from None

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
                with open(os.path.join(self._dir(controller, path), "cgroup.procs")) as handle:
                    pids.update(int(p) for p in handle.read().split())
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
                with open(os.path.join(self._dir(controller, path), "cgroup.procs")) as handle:
                    members[controller] = {int(p) for p in handle.read().split()}
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
            try:
                names.update(e for e in os.listdir(directory) if os.path.isdir(os.path.join(directory, e)))
            except OSError:
                pass
        return sorted(names)

    def memory_usage_bytes(self, path: str) -> Optional[int]:
        if self.version == 1:
            text = self.read("memory", path, "memory.usage_in_bytes") if "memory" in self.bases else None
        else:
            text = self.read("", path, "memory.current")
        return int(text) if text and text.strip().isdigit() else None

    def kill(self, path: str, sig: int) -> List[int]:
        """Signal every process of the cgroup and its descendants; returns the pids signalled."""
        signalled = []
        for pid in _all_procs(self, path):
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
        removed (and maybe made again) is reopened once; gone, it reads ``None``."""
        target = os.path.join(self._dir(controller, path), file)
        state = {"fd": None}

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
                    os.close(state["fd"])
                    state["fd"] = None
            return None

        return read

    def usage_reader(self, path: str):
        """A function returning the cgroup's cumulative cpu ns (see ``file_reader``)."""
        if self.version == 1:
            if "cpuacct" not in self.bases:
                return lambda: None
            read = self.file_reader("cpuacct", path, "cpuacct.usage")
            return lambda: _int_or_none(read())
        read = self.file_reader("", path, "cpu.stat")

        def usage() -> Optional[int]:
            for line in (read() or "").splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) * 1000
            return None

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


def _int_or_none(text: Optional[str]) -> Optional[int]:
    return int(text) if text and text.strip().isdigit() else None


def _all_procs(driver, path: str) -> List[int]:
    pids = list(driver.procs(path))
    for child in driver.children(path):
        pids.extend(_all_procs(driver, f"{path}/{child}"))
    return pids


class RecordingCgroups:
    """In-memory cgroups that record every operation (``ops``) and never touch the host."""

    def __init__(self, version: int = 1, features: Optional[Dict[str, bool]] = None) -> None:
        self.version = version
        self.features = dict(features or {"cpu.idle": True, "memory": True})
        self.files: Dict[str, Dict[Tuple[str, str], str]] = {"": {}}
        self.members: Dict[str, List[int]] = {"": []}
        self.ops: List[Tuple] = []
        self.usage: Dict[str, int] = {}
        self.memory: Dict[str, int] = {}
        self.percpu: Dict[str, List[int]] = {}

    def where(self, path: str) -> Dict[str, str]:
        return {"recorded": path}

    def membership_dir(self, path: str) -> Optional[str]:
        return None

    def exists(self, path: str) -> bool:
        return path in self.files

    present = exists

    def create(self, path: str) -> None:
        if path not in self.files:
            self.files[path] = {}
            self.members[path] = []
            self.ops.append(("create", path))

    def remove(self, path: str) -> None:
        if self.members.get(path):
            raise CgroupError(f"{path}: cannot remove cgroup: Device or resource busy")
        if any(p.startswith(path + "/") for p in self.files):
            raise CgroupError(f"{path}: cannot remove cgroup: Device or resource busy")
        self.files.pop(path, None)
        self.members.pop(path, None)
        self.ops.append(("remove", path))

    def read(self, controller: str, path: str, file: str) -> Optional[str]:
        return self.files.get(path, {}).get((controller, file))

    def write(self, controller: str, path: str, file: str, text: str) -> None:
        if path not in self.files:
            raise CgroupError(f"{path}/{file}: no such cgroup")
        self.files[path][(controller, file)] = text
        self.ops.append(("write", path, controller, file, text))

    def procs(self, path: str) -> List[int]:
        return list(self.members.get(path, []))

    def move(self, path: str, pid: int) -> None:
        if path not in self.members:
            raise CgroupError(f"{path}: no such cgroup")
        for members in self.members.values():
            if pid in members:
                members.remove(pid)
        self.members[path].append(pid)
        self.ops.append(("move", path, pid))

    def children(self, path: str) -> List[str]:
        prefix = path + "/" if path else ""
        return sorted({p[len(prefix):].split("/")[0] for p in self.files if p.startswith(prefix) and p != path})

    def cpu_usage_ns(self, path: str) -> Optional[int]:
        return self.usage.get(path)

    def usage_reader(self, path: str):
        return lambda: self.usage.get(path)

    def percpu_reader(self, path: str):
        return lambda: self.percpu.get(path)

    def memory_usage_bytes(self, path: str) -> Optional[int]:
        return self.memory.get(path)

    def kill(self, path: str, sig: int) -> List[int]:
        pids = _all_procs(self, path)
        for members in self.members.values():
            for pid in pids:
                if pid in members:
                    members.remove(pid)
        self.ops.append(("kill", path, sig, tuple(pids)))
        return pids

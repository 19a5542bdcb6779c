"""Cgroups kept in memory: every operation recorded (``ops``), nothing written to the host.

The driver of ``tidal agent --cgroups-in-memory`` (a dry run: what the agent would do to the kernel,
without doing it) and the recording fake the tests of the layers above the kernel pass in
(architecture.md, convention 7; the real writer is tested against a real kernel in tests/privileged).
It answers as ``KernelCgroups`` does, including the kernel's own rules that callers depend on: a cgroup
with members or children cannot be removed, a line of ``io.max`` sets its device only.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from agent.isolation.cgroups.detect import CgroupError
from agent.isolation.cgroups.driver import procs_in_tree


class RecordingCgroups:
    """In-memory cgroups that record every operation (``ops``) and never touch the host."""

    def __init__(self, version: int = 1, features: Optional[Dict[str, bool]] = None) -> None:
        self.version = version
        self.features = dict(features or {"cpu.idle": True, "cpu.burst": True, "memory": True})
        self.files: Dict[str, Dict[Tuple[str, str], str]] = {"": {}}
        self.members: Dict[str, List[int]] = {"": []}
        self.ops: List[Tuple] = []
        self.usage: Dict[str, int] = {}
        self.memory: Dict[str, int] = {}
        self.percpu: Dict[str, List[int]] = {}
        self.ceiling: Optional[Tuple[int, int]] = None  # (limit, available) above the tree, as tests set it

    def where(self, path: str) -> Dict[str, str]:
        return {"recorded": path}

    def root_view(self) -> "RecordingCgroups":
        return self

    def membership_dir(self, path: str) -> Optional[str]:
        return None

    def prepare(self, base: str) -> List[int]:
        return []

    def pressure(self, path: str, resource: str) -> Optional[Dict[str, Dict[str, float]]]:
        return None

    def memory_ceiling(self) -> Optional[Tuple[int, int]]:
        return self.ceiling

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
        if file == "io.max":  # as the kernel: a line sets its device's limits, the other devices keep theirs
            lines = {line.split()[0]: line for line in (self.files[path].get((controller, file)) or "").splitlines()
                     if line.split()}
            lines[text.split()[0]] = text
            self.ops.append(("write", path, controller, file, text))
            self.files[path][(controller, file)] = "\n".join(
                line for _, line in sorted(lines.items()) if "rbps=max wbps=max" not in line)
            return
        self.files[path][(controller, file)] = text
        self.ops.append(("write", path, controller, file, text))

    def procs(self, path: str) -> List[int]:
        return list(self.members.get(path, []))

    def join_offline(self, path: str, pid: int) -> None:
        self.create(path)
        self.move(path, pid)

    def procs_anywhere(self, path: str) -> List[int]:
        return self.procs(path)

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

    def memory_working_set_bytes(self, path: str) -> Optional[int]:
        return self.memory.get(path)  # a recording has no page cache

    def kill(self, path: str, sig: int) -> List[int]:
        pids = procs_in_tree(self, path)
        for members in self.members.values():
            for pid in pids:
                if pid in members:
                    members.remove(pid)
        self.ops.append(("kill", path, sig, tuple(pids)))
        return pids

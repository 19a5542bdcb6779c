"""Which cgroup version and controllers this host offers, and where.

Read from the mount table (``/proc/self/mounts`` under the HostFS root),
which carries what ``statfs`` of ``/sys/fs/cgroup`` and
``/sys/fs/cgroup/unified`` would tell (cgroup2 vs tmpfs of v1 hierarchies)
plus where each v1 controller is mounted, and works on captured trees.

* v2: a ``cgroup2`` mount whose ``cgroup.controllers`` lists cpu and cpuset
  (Documentation/admin-guide/cgroup-v2.rst).
* v1: ``cgroup`` mounts with options naming the controllers
  (Documentation/admin-guide/cgroup-v1/). A cgroup2 mount beside them with no
  controllers (``/sys/fs/cgroup/unified`` here) is recorded as ``unified``:
  membership only, which the network classifier can match on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from agent.errors import TidalError
from agent.topology.hostfs import HostFS

V1_CONTROLLERS = ("cpuset", "cpu", "cpuacct", "memory")


class CgroupError(TidalError):
    """cgroups are missing, unsupported or a write was refused."""


@dataclass(frozen=True)
class CgroupMounts:
    version: int
    mounts: Dict[str, str] = field(default_factory=dict)  # v1: controller -> mount point; v2: {"": root}
    unified: Optional[str] = None  # cgroup2 mount point (v2 root, or the v1 hybrid's membership tree)
    features: Dict[str, bool] = field(default_factory=dict)

    def mount_of(self, controller: str) -> str:
        if self.version == 2:
            return self.mounts[""]
        try:
            return self.mounts[controller]
        except KeyError:
            raise CgroupError(f"cgroup v1 controller {controller!r} is not mounted") from None


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def detect(fs: HostFS) -> CgroupMounts:
    """Inspect the mount table; raise ``CgroupError`` if neither version is usable."""
    text = fs.read("/proc/self/mounts") or fs.read("/proc/mounts")
    if text is None:
        raise CgroupError(f"{fs.path('/proc/self/mounts')}: missing; cannot find cgroup mounts")
    v1: Dict[str, str] = {}
    unified: Optional[str] = None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount_point, fstype, options = _unescape(fields[1]), fields[2], fields[3].split(",")
        if fstype == "cgroup2":
            unified = unified or mount_point
        elif fstype == "cgroup":
            for controller in V1_CONTROLLERS:
                if controller in options:
                    v1.setdefault(controller, mount_point)
    if unified is not None:
        controllers = (fs.read(f"{unified}/cgroup.controllers") or "").split()
        if "cpu" in controllers and "cpuset" in controllers:
            features = {"cpu.idle": fs.exists(f"{unified}/cpu.idle") or _child_has(fs, unified, "cpu.idle"),
                        "cpu.burst": _child_has(fs, unified, "cpu.max.burst"),
                        "memory": "memory" in controllers,
                        # memory.low/min: v2 only
                        "memory_protection": "memory" in controllers,
                        "io": "io" in controllers}
            return CgroupMounts(2, {"": unified}, unified, features)
    if "cpuset" in v1 and "cpu" in v1:
        features = {"cpu.idle": fs.exists(f"{v1['cpu']}/cpu.idle"), "memory": "memory" in v1,
                    "cpu.burst": fs.exists(f"{v1['cpu']}/cpu.cfs_burst_us"),
                    "cpuacct": "cpuacct" in v1}
        return CgroupMounts(1, v1, unified, features)
    raise CgroupError("no usable cgroups: need cgroup v2 with the cpu and cpuset controllers, "
                      "or cgroup v1 cpuset and cpu hierarchies")


def _child_has(fs: HostFS, root: str, name: str) -> bool:
    """The v2 root cgroup has no cpu.idle of its own; a child shows whether the kernel has it."""
    for entry in fs.listdir(root):
        if fs.isdir(f"{root}/{entry}") and fs.exists(f"{root}/{entry}/{name}"):
            return True
    return False

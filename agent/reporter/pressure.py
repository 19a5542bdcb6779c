"""Online's stall share from PSI (pressure stall information).

``some`` is the share of wall time in which at least one task of a cgroup
waited for a resource (memory: reclaim, refaults, swap-in; cpu: a runqueue;
io: the block layer). The kernel keeps it per cgroup on cgroup v2 (on a
hybrid v1 host in the cgroup2 mirror, whose members are the same tasks) and
node-wide in ``/proc/pressure``.

``PressureMeter`` reads the cumulative ``total`` counter (microseconds of
stall) of each online cgroup and reports the share over the interval since
its last sample, in percent: exact over any interval, where the kernel's
``avg10`` is a 10 s running average that trails a step by seconds. The figure
is the worst online cgroup's (one stalled service is a stalled service).
Where no online cgroup has a pressure file (no PSI in the cgroup mirror), the
node-wide file is the fallback, and ``scope`` says so: it counts offline work's
own stalls too (a reclaimed tree throttled at its ``memory.high`` stalls by
design), so it can only overstate online's pressure.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, Optional, Tuple

PressureReader = Callable[[str, str], Optional[Dict[str, Dict[str, float]]]]  # (cgroup path, resource)


def node_pressure(resource: str, root: str = "/") -> Optional[Dict[str, Dict[str, float]]]:
    """``/proc/pressure/<resource>`` parsed, or ``None`` (no PSI: kernel without it, or booted ``psi=0``)."""
    from agent.isolation.cgroups.driver import parse_pressure

    try:
        with open(f"{root.rstrip('/')}/proc/pressure/{resource}") as handle:
            return parse_pressure(handle.read())
    except OSError:
        return None


class PressureFiles:
    """Pressure files kept open (read again with ``pread``: a third of an open, read and close), for the
    fast guard's every-interval reads; a file that fails is closed and opened afresh next time (a cgroup
    removed and made again)."""

    def __init__(self, locate: Callable[[str], Optional[str]]) -> None:
        """``locate(path)``: the cgroup2 directory of a cgroup (the driver's ``membership_dir``)."""
        self.locate = locate
        self._fds: Dict[Tuple[str, str], int] = {}

    def read(self, path: str, resource: str) -> Optional[Dict[str, Dict[str, float]]]:
        from agent.isolation.cgroups.driver import parse_pressure

        key = (path, resource)
        fd = self._fds.get(key)
        try:
            if fd is None:
                directory = self.locate(path)
                if directory is None:
                    return None
                fd = self._fds[key] = os.open(os.path.join(directory, f"{resource}.pressure"), os.O_RDONLY)
            return parse_pressure(os.pread(fd, 4096, 0).decode())
        except OSError:
            if fd is not None:
                os.close(fd)
            self._fds.pop(key, None)
            return None

    def retain(self, resource: str, paths: Iterable[str]) -> None:
        """Close the kept files of ``resource`` whose cgroup is no longer among ``paths`` (an online pod
        deleted): never read again, they would stay open for the agent's life, one per pod it ever saw."""
        live = set(paths)
        for key in [key for key in self._fds if key[1] == resource and key[0] not in live
                    and key[0] != "/proc/pressure"]:
            os.close(self._fds.pop(key))

    def node_total(self, resource: str, kind: str = "some") -> Optional[float]:
        """The node's cumulative stall (``/proc/pressure/<resource>``, ``kind``'s ``total``, microseconds),
        from a file kept open like the cgroups'; None without PSI."""
        key = ("/proc/pressure", resource)
        fd = self._fds.get(key)
        try:
            if fd is None:
                fd = self._fds[key] = os.open(f"/proc/pressure/{resource}", os.O_RDONLY)
            for line in os.pread(fd, 4096, 0).decode().splitlines():
                if line.startswith(kind + " "):
                    return float(line.rpartition("total=")[2])
        except (OSError, ValueError):
            if fd is not None:
                os.close(fd)
            self._fds.pop(key, None)
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class PressureMeter:
    def __init__(self, read: PressureReader, paths: Callable[[], Iterable[str]], resource: str = "memory",
                 kind: str = "some", node: Optional[Callable[[str], Optional[Dict[str, Dict[str, float]]]]] = None,
                 gate: Optional[Callable[[], Optional[float]]] = None, refresh_s: Optional[float] = None,
                 files: Optional[PressureFiles] = None) -> None:
        """``gate``: the node's cumulative stall of the same kind (``PressureFiles.node_total``). Where it
        has not moved since the last sample no task anywhere stalled, online's neither: the sample is 0
        without reading each online cgroup (one read instead of one per cgroup, every guard interval).
        ``refresh_s``: read them anyway once that long passed since the last read, so that ``avg10`` (the
        kernel's running average, shown in status) is never older than that. ``files``: the kept-open files
        ``read`` reads from; those of cgroups no longer in ``paths`` are closed when the list changes."""
        self.read = read
        self.gate = gate
        self.refresh_s = refresh_s
        self.files = files
        self._files_paths: Optional[object] = None  # the path list the kept files were last pruned to
        self._gate: Optional[float] = None
        self._read_at: Optional[float] = None  # when the cgroups were last read
        self.paths = paths
        self.resource = resource
        self.kind = kind
        self.node = node if node is not None else node_pressure
        self.scope: Optional[str] = None  # "cgroups", "node" or None (no PSI anywhere)
        self.percent: Optional[float] = None  # the last sample
        self.avg10: Optional[float] = None  # the kernel's own running average, for the record
        self._last: Tuple[Optional[float], Dict[str, float]] = (None, {})

    def _totals(self) -> Tuple[Optional[str], Dict[str, Tuple[float, float]]]:
        """``{path: (total_us, avg10)}`` of the online cgroups, else of the node."""
        found: Dict[str, Tuple[float, float]] = {}
        paths = self.paths()
        if self.files is not None and paths is not self._files_paths:  # the owner's list changes only with them
            self.files.retain(self.resource, paths)
            self._files_paths = paths
        for path in paths:
            doc = self.read(path, self.resource)
            figures = (doc or {}).get(self.kind)
            if figures and "total" in figures:
                found[path] = (figures["total"], figures.get("avg10", 0.0))
        if found:
            return "cgroups", found
        doc = self.node(self.resource)
        figures = (doc or {}).get(self.kind)
        if figures and "total" in figures:
            return "node", {"/": (figures["total"], figures.get("avg10", 0.0))}
        return None, {}

    def sample(self, now: float) -> Optional[float]:
        """The worst online cgroup's stall share (percent) since the previous sample; ``None`` on the
        first sample and where the kernel keeps no PSI."""
        if self.gate is not None:
            gate, last_gate = self.gate(), self._gate
            self._gate = gate
            fresh = self.refresh_s is None or (self._read_at is not None and now - self._read_at < self.refresh_s)
            if gate is not None and gate == last_gate and self.scope == "cgroups" and self._last[0] is not None \
                    and fresh:
                self._last = (now, self._last[1])  # the online cgroups' totals are where they were
                self.percent = 0.0
                return self.percent
        scope, totals = self._totals()
        self._read_at = now
        last_time, last = self._last
        self._last = (now, {path: total for path, (total, _) in totals.items()})
        self.scope = scope
        self.avg10 = max((avg for _, avg in totals.values()), default=None)
        shares = [(total - last[path]) / ((now - last_time) * 1e6) * 100.0
                  for path, (total, _) in totals.items()
                  if last_time is not None and now > last_time and path in last and total >= last[path]]
        self.percent = round(min(100.0, max(shares)), 2) if shares else None
        return self.percent

"""An offline system's daemon is infrastructure; its containers are the work.

A YARN NodeManager runs in its own cgroup (``--yarn-nodemanager-cgroup``, declared offline: its cpu and
memory are not online demand) that lending never touches: the NodeManager lives through every lend and
reclaim and stays registered with the ResourceManager. What it launches is another matter: every process
of that cgroup with ``CONTAINER_ID`` in its environment (YARN sets it in every container's launch script,
whatever the executor) is moved, within a period, into one reclaimed workload of Tidal's tree per daemon
cgroup (``<name>-containers``): there the kernel bounds it (idle priority, the reclaimed quota, memory
limits), the capacity counts it as offline, and what ends offline work (the end of a lending notice,
capacity gone, memory short) stops the containers and leaves the NodeManager running.

The workload stays while its daemon's containers come and go (``Admission.standing``): a container
YARN starts during a lending notice (shown the floor from the notice's start) joins it, and the
notice's end stops it with the rest. Where the workload cannot be admitted (no cpu left for reclaimed
work, the node in a transition: after an eviction),
containers that YARN placed anyway are killed, each once, and counted (``refused``): nothing runs outside
the bounds Tidal sets. A YARN told only what Tidal gives places none there (``reporter.yarn``).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable, Dict, Optional, Set, Tuple

from agent.errors import TidalError

log = logging.getLogger("tidal.agent")
MARK = b"CONTAINER_ID="


def container_of(pid: int, proc: str = "/proc") -> Optional[str]:
    """The YARN container a process belongs to (its ``CONTAINER_ID``), None for any other process."""
    try:
        with open(f"{proc}/{pid}/environ", "rb") as handle:
            environ = handle.read(1 << 20)
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(MARK):
            return entry[len(MARK):].decode(errors="replace")[:128] or None
    return None


def start_time(pid: int, proc: str = "/proc") -> Optional[int]:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat field 22): a pid with the same
    start time is the same process (pids are reused)."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as handle:
            text = handle.read()
        return int(text.rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def workload_name(cgroup: str) -> str:
    base = [p for p in cgroup.split("/") if p][-1]
    return f"{base}-containers"[:128]


class OfflineContainers:
    """``cgroups``: the daemons' cgroups (from the hierarchies' roots); ``procs(path)``: their processes;
    ``admit(doc)``, ``attach(name, pid)``, ``exists(name)``: the agent's admission; ``tier``: of the
    containers' workload."""

    def __init__(self, cgroups, procs: Callable[[str], list], admit: Callable[[dict], object],
                 attach: Callable[[str, int], object], exists: Callable[[str], bool], tier: str = "low",
                 proc: str = "/proc", kill: Callable[[int, int], None] = os.kill) -> None:
        self.cgroups = tuple(c.strip("/") for c in cgroups)
        self.procs, self.admit, self.attach, self.exists = procs, admit, attach, exists
        self.tier = tier
        self.proc = proc
        self.kill = kill
        self.known: Dict[int, Tuple[Optional[int], Optional[str]]] = {}  # pid -> (start time, container)
        self.adopted = 0  # processes moved into the containers' workload
        self.refused = 0  # container processes killed: no room for them
        self.last_refusal: Optional[str] = None
        self.daemons: Dict[str, Set[int]] = {}  # cgroup -> its own (non-container) processes, as last seen
        self.attach_failures = 0  # container processes the kernel would not move (each counted once)
        self.last_attach_error: Optional[str] = None
        self.failing: Set[int] = set()  # container processes whose move failed, while they are still there

    def workloads(self) -> Dict[str, str]:
        return {path: workload_name(path) for path in self.cgroups}

    def adopt(self) -> int:
        """One pass: every container process of the daemons' cgroups into its workload; how many moved."""
        moved = 0
        live: Set[int] = set()
        for path in self.cgroups:
            try:
                pids = self.procs(path)
            except (OSError, TidalError):
                continue
            live.update(pids)
            containers, daemons = [], set()
            for pid in pids:
                started = start_time(pid, self.proc)
                seen = self.known.get(pid)
                if seen is None or seen[0] != started:
                    seen = (started, container_of(pid, self.proc))
                    self.known[pid] = seen
                if seen[1]:
                    containers.append(pid)
                else:
                    daemons.add(pid)
            self.daemons[path] = daemons
            if containers:
                moved += self._take(path, containers)
        self.known = {pid: seen for pid, seen in self.known.items() if pid in live}
        self.failing &= live
        return moved

    def _take(self, path: str, pids) -> int:
        name = workload_name(path)
        if not self.exists(name):
            try:
                self.admit({"name": name, "qos": "reclaimed_cores", "millicpu": 1, "tier": self.tier})
                log.info("%s: containers of %s run in reclaimed workload %s from now on", path, path, name)
            except TidalError as exc:
                self.last_refusal = f"{name}: {exc}"
                for pid in pids:
                    try:
                        self.kill(pid, signal.SIGKILL)
                        self.refused += 1
                    except ProcessLookupError:
                        pass
                log.warning("killed %d container process(es) of %s: no room for reclaimed work (%s)", len(pids),
                            path, exc)
                return 0
        moved = 0
        for pid in pids:
            try:
                self.attach(name, pid)
                moved += 1
                self.failing.discard(pid)
            except TidalError as exc:
                if not os.path.exists(f"{self.proc}/{pid}"):
                    continue  # ended meanwhile
                # the kernel would not move it (e.g. EPERM: a cpuset move of a task holding capabilities the
                # agent lacks needs CAP_SYS_NICE): the container runs unbounded in the daemon's cgroup, so
                # say so, once per process, and count it; the next pass tries again
                self.last_attach_error = f"{name}: {exc}"
                if pid not in self.failing:
                    self.failing.add(pid)
                    self.attach_failures += 1
                    log.warning("container process %d of %s stays in %s: %s", pid, path, path, exc)
        self.adopted += moved
        return moved

    def status(self) -> Dict[str, object]:
        return {"cgroups": {path: {"workload": workload_name(path), "daemon_pids": sorted(self.daemons.get(path, ()))}
                            for path in self.cgroups},
                "adopted": self.adopted, "refused": self.refused, "last_refusal": self.last_refusal,
                "attach_failures": self.attach_failures, "unmoved": len(self.failing),
                "last_attach_error": self.last_attach_error}

"""A cgroup outside Tidal's tree, as an offline system makes one for itself (YARN's own cgroups, a
Mesos agent's): what ``tidal agent --offline-cgroup`` declares."""

from __future__ import annotations

import os
import shlex
import time

from agent.isolation.cgroups.detect import detect
from agent.topology import HostFS


class OfflineCgroup:
    """``name`` at the hierarchies' roots: cpu/cpuacct and memory on v1 (accounting only), one directory
    on v2. Processes join through ``wrap(argv)``."""

    def __init__(self, name: str) -> None:
        mounts = detect(HostFS("/"))
        self.name = name
        if mounts.version == 2:
            self.dirs = [f"{mounts.mounts['']}/{name}"]
        else:
            self.dirs = sorted({f"{mounts.mounts[c]}/{name}" for c in ("cpuacct", "memory") if c in mounts.mounts})
        # what remove() takes away: the agent makes the name in the other hierarchies it writes (v1's cpu,
        # where cpu.idle is, when a process first joins), and they stayed behind after every YARN run
        self.everywhere = sorted({f"{m}/{name}" for m in mounts.mounts.values()})
        for path in self.dirs:
            os.makedirs(path, exist_ok=True)

    def wrap(self, argv):
        """argv run inside the cgroup: a shell joins it, then becomes the command."""
        joins = "; ".join(f"echo $$ > {shlex.quote(d)}/cgroup.procs" for d in self.dirs)
        return ["sh", "-c", f'{joins}; exec "$@"', "sh", *argv]

    def remove(self) -> None:
        for path in self.everywhere:
            for _ in range(50):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)

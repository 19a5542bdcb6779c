"""``tidal bench topology``: in-process discovery time beside hwloc's lstopo.

Discovery is timed in-process (what the agent pays at start and on a CPU
hotplug event); ``lstopo-no-graphics --input ROOT`` is timed as a whole
process, which is how operators run it. Both take the median of ``repeat``
runs after one warm-up so the page cache is equally warm for both.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, Dict

from common.timing import median, time_ms
from agent.topology import HostFS, discover


def run(root: str, repeat: int = 20) -> Dict[str, Any]:
    fs = HostFS(root)
    topo = discover(fs, use_cpuinfo_lib=False)
    discovery = time_ms(lambda: discover(fs, use_cpuinfo_lib=False), repeat)
    lstopo = shutil.which("lstopo-no-graphics") or shutil.which("lstopo")
    lstopo_ms = None
    if lstopo:
        cmd = [lstopo, "--input", fs.root, "--of", "xml", "-"]

        def one() -> None:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

        lstopo_ms = round(median(time_ms(one, max(3, repeat // 4))), 3)
    discovery_ms = round(median(discovery), 3)
    return {
        "root": fs.root,
        "cpus": len(topo.online_cpus()),
        "discovery_ms": discovery_ms,
        "discovery_p90_ms": round(sorted(discovery)[int(0.9 * (len(discovery) - 1))], 3),
        "lstopo_ms": lstopo_ms,
        "lstopo_path": lstopo,
        "ratio_lstopo_over_tidal": round(lstopo_ms / discovery_ms, 1) if lstopo_ms else None,
        "repeat": repeat,
    }

"""One table from Tidal's logical knobs to each cgroup version's files.

| knob        | v1 (controller: file)                          | v2 file                 |
|-------------|------------------------------------------------|-------------------------|
| cpus        | cpuset: cpuset.cpus                            | cpuset.cpus             |
| mems        | cpuset: cpuset.mems                            | cpuset.mems             |
| cpus_exclusive | (none)                                      | cpuset.cpus.exclusive   |
| partition   | (none)                                         | cpuset.cpus.partition   |
| cpu_shares  | cpu: cpu.shares                                | cpu.weight (converted)  |
| cpu_max     | cpu: cpu.cfs_period_us, then cpu.cfs_quota_us  | cpu.max "quota period"  |
| cpu_idle    | cpu: cpu.idle                                  | cpu.idle                |
| memory_max  | memory: memory.limit_in_bytes (-1 = none)      | memory.max ("max")      |
| memory_high | (none)                                         | memory.high             |
| memory_low  | (none)                                         | memory.low              |
| memory_min  | (none)                                         | memory.min              |
| memory_soft_limit | memory: memory.soft_limit_in_bytes (-1 = none) | (none: memory.low on online is v2's way) |

Values are logical: ``cpus``/``mems`` cpu-list strings, ``cpu_shares`` in
v1 shares (1024 per cpu; the kubelet's unit), ``cpu_max`` a pair
``(quota_us or None, period_us)``, memory in bytes or ``None`` for no limit.

shares <-> weight is the conversion runc and the kubelet use
(``weight = 1 + (shares - 2) * 9999 / 262142``), so Tidal's values read the
same as a kubelet's on either version.
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Tuple

from agent.topology.parse import format_cpulist, parse_cpulist

FileWrite = Tuple[str, str, str]  # (controller, file, text); controller "" on v2


def shares_to_weight(shares: int) -> int:
    shares = max(2, min(262144, int(shares)))
    return 1 + ((shares - 2) * 9999) // 262142


def weight_to_shares(weight: int) -> int:
    weight = max(1, min(10000, int(weight)))
    return 2 + ((weight - 1) * 262142) // 9999


def _cpulist(value: Any) -> str:
    return value if isinstance(value, str) else format_cpulist(value)


def _v1_mem(value: Optional[int]) -> str:
    return "-1" if value is None else str(int(value))


def _v2_mem(value: Optional[int]) -> str:
    return "max" if value is None else str(int(value))


def files_for(version: int, knob: str, value: Any) -> List[FileWrite]:
    """The file writes that set ``knob`` to ``value``; ``[]`` where the version has no such file."""
    if knob == "cpus":
        return [("cpuset", "cpuset.cpus", _cpulist(value))] if version == 1 else [("", "cpuset.cpus", _cpulist(value))]
    if knob == "mems":
        return [("cpuset", "cpuset.mems", _cpulist(value))] if version == 1 else [("", "cpuset.mems", _cpulist(value))]
    if knob == "cpus_exclusive":
        return [] if version == 1 else [("", "cpuset.cpus.exclusive", _cpulist(value))]
    if knob == "partition":
        return [] if version == 1 else [("", "cpuset.cpus.partition", str(value))]
    if knob == "cpu_shares":
        if version == 1:
            return [("cpu", "cpu.shares", str(int(value)))]
        return [("", "cpu.weight", str(shares_to_weight(value)))]
    if knob == "cpu_max":
        quota, period = value
        if version == 1:
            return [("cpu", "cpu.cfs_period_us", str(int(period))),
                    ("cpu", "cpu.cfs_quota_us", "-1" if quota is None else str(int(quota)))]
        return [("", "cpu.max", f"{'max' if quota is None else int(quota)} {int(period)}")]
    if knob == "cpu_idle":
        return [("cpu", "cpu.idle", str(int(value)))] if version == 1 else [("", "cpu.idle", str(int(value)))]
    if knob == "memory_max":
        return [("memory", "memory.limit_in_bytes", _v1_mem(value))] if version == 1 else \
            [("", "memory.max", _v2_mem(value))]
    if knob == "memory_soft_limit":
        return [("memory", "memory.soft_limit_in_bytes", _v1_mem(value))] if version == 1 else []
    if knob in ("memory_high", "memory_low", "memory_min"):
        return [] if version == 1 else [("", knob.replace("_", "."), _v2_mem(value) if knob == "memory_high"
                                         else str(int(value or 0)))]
    raise KeyError(f"unknown cgroup knob {knob!r}")


_V1_MAX_BYTES = 9223372036854771712  # what memory.limit_in_bytes reads back for "-1" (page-rounded LONG_MAX)


@functools.lru_cache(maxsize=4096)
def normalize(file: str, text: Optional[str]) -> Optional[str]:
    """Canonical form of a file's content, so written and read-back values compare."""
    if text is None:
        return None
    text = text.strip()
    if file in ("cpuset.cpus", "cpuset.mems", "cpuset.cpus.exclusive"):
        try:
            return format_cpulist(parse_cpulist(text))
        except ValueError:
            return text
    if file in ("memory.limit_in_bytes", "memory.soft_limit_in_bytes") and text not in ("-1",):
        try:
            return "-1" if int(text) >= _V1_MAX_BYTES else text
        except ValueError:
            return text
    if file == "cpuset.cpus.partition":
        return text.split()[0] if text else text
    return text

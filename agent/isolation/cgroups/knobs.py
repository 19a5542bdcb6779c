"""One table from Tidal's logical knobs to each cgroup version's files.

| knob        | v1 (controller: file)                          | v2 file                 |
|-------------|------------------------------------------------|-------------------------|
| cpus        | cpuset: cpuset.cpus                            | cpuset.cpus             |
| mems        | cpuset: cpuset.mems                            | cpuset.mems             |
| cpus_exclusive | (none)                                      | cpuset.cpus.exclusive   |
| partition   | (none)                                         | cpuset.cpus.partition   |
| cpu_shares  | cpu: cpu.shares                                | cpu.weight (converted)  |
| cpu_max     | cpu: cpu.cfs_period_us, then cpu.cfs_quota_us  | cpu.max "quota period"  |
| cpu_burst   | cpu: cpu.cfs_burst_us                          | cpu.max.burst           |
| cpu_idle    | cpu: cpu.idle                                  | cpu.idle                |
| memory_max  | memory: memory.limit_in_bytes (-1 = none)      | memory.max ("max")      |
| memory_high | (none)                                         | memory.high             |
| memory_low  | (none)                                         | memory.low              |
| memory_min  | (none)                                         | memory.min              |
| memory_soft_limit | memory: memory.soft_limit_in_bytes (-1 = none) | (none: memory.low on online is v2's way) |
| io_max      | (none: blkio throttles no buffered writes)     | io.max, a line per device |

Values are logical: ``cpus``/``mems`` cpu-list strings, ``cpu_shares`` in
v1 shares (1024 per cpu; the kubelet's unit; ``None`` the kernel's default: 1024, weight 100), ``cpu_max`` a pair
``(quota_us or None, period_us)``, ``cpu_burst`` microseconds of unused
quota a period may borrow (never above the quota: the kernel refuses), memory in
bytes or ``None`` for no limit (``memory_low``/``memory_min``: ``None`` none,
``"max"`` all the cgroup uses), ``io_max`` the bandwidth limits ``((device, read_bps or None, write_bps or
None), ...)`` of every device (``()``: none anywhere).

``io.max`` is a file of lines, one per device, and the kernel takes one line
per write: its text here is all the lines; ``line_writes`` says which to
write to go from what a file holds to what it should (a device limited there
and not wanted is lifted), and ``satisfied`` compares the two.

shares <-> weight is the conversion runc and the kubelet use
(``weight = 1 + (shares - 2) * 9999 / 262142``), so Tidal's values read the
same as a kubelet's on either version.
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Tuple

from agent.isolation.cgroups.blockio import parse_io_max
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
    if knob == "cpu_shares":  # None: the kernel's default weight (v1 1024 shares, v2 weight 100)
        if version == 1:
            return [("cpu", "cpu.shares", "1024" if value is None else str(int(value)))]
        return [("", "cpu.weight", "100" if value is None else str(shares_to_weight(value)))]
    if knob == "cpu_max":
        quota, period = value
        if version == 1:
            return [("cpu", "cpu.cfs_period_us", str(int(period))),
                    ("cpu", "cpu.cfs_quota_us", "-1" if quota is None else str(int(quota)))]
        return [("", "cpu.max", f"{'max' if quota is None else int(quota)} {int(period)}")]
    if knob == "cpu_burst":
        return [("cpu", "cpu.cfs_burst_us", str(int(value)))] if version == 1 else \
            [("", "cpu.max.burst", str(int(value)))]
    if knob == "cpu_idle":
        return [("cpu", "cpu.idle", str(int(value)))] if version == 1 else [("", "cpu.idle", str(int(value)))]
    if knob == "memory_max":
        return [("memory", "memory.limit_in_bytes", _v1_mem(value))] if version == 1 else \
            [("", "memory.max", _v2_mem(value))]
    if knob == "memory_soft_limit":
        return [("memory", "memory.soft_limit_in_bytes", _v1_mem(value))] if version == 1 else []
    if knob == "io_max":
        return [] if version == 1 else [("", "io.max", _io_lines({d: (r, w) for d, r, w in value}))]
    if knob in ("memory_high", "memory_low", "memory_min"):
        if version == 1:
            return []
        # memory.high: None is no limit; memory.low/min: None is none, "max" all the cgroup uses
        text = _v2_mem(value) if knob == "memory_high" else "max" if value == "max" else str(int(value or 0))
        return [("", knob.replace("_", "."), text)]
    raise KeyError(f"unknown cgroup knob {knob!r}")


def _io_line(device: str, pair) -> str:
    rbps, wbps = ("max" if v is None else str(int(v)) for v in pair)
    return f"{device} rbps={rbps} wbps={wbps}"


def _io_lines(limits) -> str:
    return "\n".join(_io_line(d, pair) for d, pair in sorted(limits.items()) if pair != (None, None))


LINE_FILES = ("io.max",)  # files the kernel takes a line (a device) per write, each line its own setting


def line_writes(file: str, actual: Optional[str], text: str) -> List[str]:
    """The writes that take ``file`` from ``actual`` to ``text``: the text itself, or for a file of
    lines only the lines that differ (a device limited there and not in ``text`` lifted)."""
    if file not in LINE_FILES:
        return [text]
    want, have = parse_io_max(text), parse_io_max(actual)
    return [_io_line(d, want.get(d, (None, None))) for d in sorted(set(want) | set(have))
            if want.get(d, (None, None)) != have.get(d, (None, None))]


def satisfied(file: str, actual: Optional[str], text: str) -> bool:
    """Whether a file holding ``actual`` already holds ``text`` (an absent file of lines holds none)."""
    if file in LINE_FILES and actual is None:
        return not parse_io_max(text)
    return normalize(file, actual) == normalize(file, text)


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
    if file in LINE_FILES:
        return _io_lines(parse_io_max(text))
    return text

"""A cgroup's block io on cgroup v2: bytes moved per device, and bandwidth limits.

* bytes moved: ``io.stat``, a line per device, ``MAJ:MIN rbytes=N wbytes=N rios=N ...``;
* a limit: ``io.max``, a line per device, ``MAJ:MIN rbps=N wbps=N`` (``max``: none); the kernel takes
  one device per write.

Devices are named ``"major:minor"``, as the kernel names them there; a limit's values are bytes per
second, ``None`` for none. This module reads; the limits are the ``io_max`` knob of the desired tree
(``knobs``), written like every other knob by the Reconciler, one device per write, with the originals of
cgroups Tidal did not make kept for revert. The io throttle (``services.io_throttle``) decides them.

Why not v1: its ``blkio`` controller throttles only io a task submits itself (reads, direct io), not the
buffered writes the kernel's flusher issues, and this kernel counts a cgroup's bytes per device
(``blkio.throttle.io_service_bytes``) only on devices where some throttle has been configured; Tidal reads
online's io pressure there (the cgroup2 mirror's ``io.pressure``) and shows it, without acting on it.
"""

from __future__ import annotations

import re
from typing import Dict, Optional, Tuple

DEVICE = re.compile(r"^\d+:\d+$")

Pair = Tuple[Optional[int], Optional[int]]  # (read, write)


def parse_io_stat(text: Optional[str]) -> Optional[Dict[str, Tuple[int, int]]]:
    """``io.stat``: {device: (read bytes, write bytes)}; ``None`` for no file."""
    if text is None:
        return None
    moved: Dict[str, Tuple[int, int]] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or not DEVICE.match(fields[0]):
            continue
        keys = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        try:
            moved[fields[0]] = (int(keys.get("rbytes", 0)), int(keys.get("wbytes", 0)))
        except ValueError:
            continue
    return moved


def parse_io_max(text: Optional[str]) -> Dict[str, Pair]:
    """``io.max``: the devices with a bandwidth limit, {device: (read, write)}."""
    limits: Dict[str, Pair] = {}
    for line in (text or "").splitlines():
        fields = line.split()
        if not fields or not DEVICE.match(fields[0]):
            continue
        keys = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        try:
            pair = tuple(None if keys.get(k, "max") == "max" else int(keys[k]) for k in ("rbps", "wbps"))
        except ValueError:
            continue
        if pair != (None, None):
            limits[fields[0]] = pair  # type: ignore[assignment]
    return limits


def read_io_bytes(driver, path: str) -> Optional[Dict[str, Tuple[int, int]]]:
    """Bytes the cgroup ``path`` (with its descendants) read and wrote per device; ``None`` where the
    kernel keeps no count (v1, or no io controller there)."""
    return parse_io_stat(driver.read("", path, "io.stat")) if driver.version == 2 else None


def read_io_limits(driver, path: str) -> Dict[str, Pair]:
    """The bandwidth limits in force on ``path``, {device: (read, write)}."""
    return parse_io_max(driver.read("", path, "io.max")) if driver.version == 2 else {}

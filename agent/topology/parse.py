"""Pure parsers for the kernel's text formats.

Raw reads live in ``hostfs``; everything here takes a string and returns
data, so each format is tested on literal strings (the cadvisor sysfs/sysinfo
split). Parsers raise ``ValueError`` with a short reason; the caller adds the
file name (see ``discover``).

Formats (Documentation/admin-guide/cputopology.rst, Documentation/core-api/
printk-formats.rst "bitmap/cpumask"):

* cpu list: ``"0-3,8,10-11"``; the kernel's parser also accepts a stride
  ``"0-15:2/4"`` (first 2 of every group of 4); the empty string is the empty set.
* cpu mask: comma-separated 32-bit hex words, most significant first:
  ``"0000ff00,00000000"`` is cpus 40-47.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

_RANGE = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?$")


MAX_CPU_ID = 65535


def parse_cpulist(text: str) -> Tuple[int, ...]:
    """Parse a kernel cpu list into a sorted tuple of cpu ids.

    Trailing NUL bytes (seen in captured trees) are ignored like white space.
    """
    text = text.strip().strip("\x00").strip()
    if not text:
        return ()
    cpus = set()
    for part in text.split(","):
        part = part.strip()
        match = _RANGE.match(part)
        if not match:
            raise ValueError(f"not a cpu list: {text!r}")
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise ValueError(f"descending range {part!r} in cpu list {text!r}")
        if last > MAX_CPU_ID:  # no kernel numbers cpus this high (NR_CPUS is at most 8192)
            raise ValueError(f"cpu {last} in {part!r} is above {MAX_CPU_ID}")
        if match.group(3) is not None:
            used, group = int(match.group(3)), int(match.group(4))
            if used == 0 or group == 0 or used > group:
                raise ValueError(f"bad stride {part!r} in cpu list {text!r}")
            for base in range(first, last + 1, group):
                cpus.update(c for c in range(base, min(base + used, last + 1)))
        else:
            cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def parse_cpumask(text: str) -> Tuple[int, ...]:
    """Parse a hex cpu mask (32-bit words, most significant first)."""
    text = text.strip().strip("\x00").strip()
    if not text:
        return ()
    words = text.split(",")
    if any(not w or len(w) > 8 for w in words):
        raise ValueError(f"not a cpu mask: {text!r}")
    try:
        value = int("".join(w.rjust(8, "0") for w in words), 16)
    except ValueError:
        raise ValueError(f"not a cpu mask: {text!r}") from None
    cpus: List[int] = []
    while value:
        low = value & -value
        cpus.append(low.bit_length() - 1)
        value ^= low
    return tuple(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Canonical cpu list string: ``[0,1,2,3,8] -> "0-3,8"``."""
    ordered = sorted(set(cpus))
    parts: List[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_int(text: str) -> int:
    """A decimal or 0x-prefixed integer, as sysfs attributes print them."""
    text = text.strip().strip("\x00").strip()
    try:
        return int(text, 0) if text.lower().startswith("0x") else int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def parse_meminfo_total(text: str) -> int:
    """Bytes of ``MemTotal`` from /proc/meminfo or nodeN/meminfo.

    The node form is ``"Node 0 MemTotal:  8386704 kB"``; the global form is
    ``"MemTotal:  8386704 kB"``.
    """
    for line in text.splitlines():
        fields = line.split()
        if "MemTotal:" in fields:
            idx = fields.index("MemTotal:")
            try:
                value = int(fields[idx + 1])
            except (IndexError, ValueError):
                raise ValueError(f"bad MemTotal line: {line!r}") from None
            unit = fields[idx + 2] if len(fields) > idx + 2 else ""
            return value * 1024 if unit.lower() == "kb" else value
    raise ValueError("no MemTotal line")


def parse_distances(text: str) -> Tuple[int, ...]:
    """A NUMA distance row, ``"10 21 21"``."""
    try:
        return tuple(int(v) for v in text.split())
    except ValueError:
        raise ValueError(f"not a distance row: {text!r}") from None


def parse_cpuinfo(text: str) -> List[Dict[str, str]]:
    """Split /proc/cpuinfo into one dict per block (see ``iter_cpuinfo``)."""
    return list(iter_cpuinfo(text))


def iter_cpuinfo(text: str) -> Iterator[Dict[str, str]]:
    """Yield /proc/cpuinfo one dict per block (blocks end at blank lines).

    Keys keep their case, stripped: old ARM kernels print both
    ``Processor : ARMv7 ...`` (the model) and ``processor : 0`` (the id) in
    one block. Architecture-wide lines (ARM's ``Hardware``, s390's
    ``vendor_id``) form blocks without a ``processor`` key.
    """
    current: Dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                yield current
                current = {}
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        current[key.strip()] = value.strip()
    if current:
        yield current


ARM_IMPLEMENTERS = {
    "0x41": "ARM", "0x42": "Broadcom", "0x43": "Cavium", "0x46": "Fujitsu", "0x48": "HiSilicon",
    "0x4e": "NVIDIA", "0x50": "APM", "0x51": "Qualcomm", "0x61": "Apple", "0xc0": "Ampere",
}
_MODEL_KEYS = ("model name", "cpu model", "Processor", "cpu", "vendor_id", "family")


def cpuinfo_model_and_flags(blocks: Iterable[Dict[str, str]]) -> Tuple[Optional[str], Tuple[str, ...]]:
    """The CPU model name and flag set from parsed /proc/cpuinfo blocks.

    Covers x86 (``model name``/``flags``), old ARM (``Processor``), arm64
    (``CPU implementer`` + ``CPU part``, ``Features``), POWER (``cpu``),
    s390 (``vendor_id``, ``features``) and ia64 (``model name``/``family``).
    """
    model: Optional[str] = None
    flags: Tuple[str, ...] = ()
    for block in blocks:
        if model is None:
            for key in _MODEL_KEYS:
                value = block.get(key)
                if value and not value.isdigit():
                    model = value
                    break
            if model is None and "CPU implementer" in block and "CPU part" in block:
                vendor = ARM_IMPLEMENTERS.get(block["CPU implementer"].lower(), block["CPU implementer"])
                model = f"{vendor} part {block['CPU part']}"
        if not flags:
            for key in ("flags", "Features", "features"):
                if block.get(key):
                    flags = tuple(sorted(set(block[key].split())))
                    break
        if model is not None and flags:
            break
    return model, flags


def cpuinfo_physical_ids(blocks: Iterable[Dict[str, str]]) -> Dict[int, Tuple[Optional[int], Optional[int]]]:
    """``{cpu: (physical id, core id)}`` from x86-style /proc/cpuinfo blocks."""
    result: Dict[int, Tuple[Optional[int], Optional[int]]] = {}
    for block in blocks:
        proc = block.get("processor")
        if proc is None or not proc.isdigit():
            continue
        phys = block.get("physical id")
        core = block.get("core id")
        result[int(proc)] = (
            int(phys) if phys is not None and phys.isdigit() else None,
            int(core) if core is not None and core.isdigit() else None,
        )
    return result

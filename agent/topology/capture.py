"""Capture the part of a host's sysfs/procfs that discovery reads, as a tree ``--root`` can read.

The tree is made by running discovery itself over a ``RecordingFS``: every
file it reads, every directory it lists and every symbolic link it follows is
noted, then copied under the capture directory with the same kernel paths.
So a capture holds exactly what ``discover`` needs to give the same answer
offline (no more: no sysfs walk, no private data), and it stays true when
discovery learns to read another file. Symbolic links are written as the
kernel has them (relative), so ``HostFS.realpath`` resolves them inside the
tree. NVML and CPUID are not files and are not captured: an offline reading
of a GPU node has the GPUs' PCI addresses and NUMA nodes, not their model or
UUID, and the cpu model and flags of ``/proc/cpuinfo``.

``tidal topology --capture DIR`` is how an operator sends a node's shape
(tests/fixtures holds such captures beside hwloc's).
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Set

from agent.errors import TopologyError
from agent.topology.hostfs import HostFS


class RecordingFS(HostFS):
    """A ``HostFS`` that notes every path discovery touches, each where it really lives (its parent
    directories resolved), so the copy has links where the kernel has links and nothing twice."""

    __slots__ = ("files", "dirs", "links", "texts")

    def __init__(self, root: str = "/") -> None:
        super().__init__(root)
        self.texts: Dict[str, str] = {}  # what discovery read, as it read it (a live file may change)
        self.files: Set[str] = set()
        self.dirs: Set[str] = set()
        self.links: Dict[str, str] = {}  # where a link lives -> its target as the kernel wrote it

    def _place(self, kernel_path: str) -> str:
        """Where ``kernel_path`` lives: its parent resolved, its last part as it is; every link on
        the way noted."""
        parent, _, name = kernel_path.rstrip("/").rpartition("/")
        real_parent = self.realpath(parent or "/")
        return f"{real_parent.rstrip('/')}/{name}"

    def _note(self, kernel_path: str, text: Optional[str] = None) -> None:
        place = self._place(kernel_path)
        real = self.path(place)
        if os.path.islink(real):
            self.links[place] = os.readlink(real)
            self._note(HostFS.realpath(self, place))
        elif os.path.isdir(real):
            self.dirs.add(place)
        elif os.path.exists(real):
            self.files.add(place)
            if text is not None:
                self.texts[place] = text

    def read(self, kernel_path: str) -> Optional[str]:
        text = super().read(kernel_path)
        if text is not None:
            self._note(kernel_path, text)
        return text

    def read_attr(self, kernel_path: str) -> Optional[str]:
        text = super().read_attr(kernel_path)
        if text is not None:
            self._note(kernel_path, text)
        return text

    def exists(self, kernel_path: str) -> bool:
        found = super().exists(kernel_path)
        if found:
            self._note(kernel_path)
        return found

    def isdir(self, kernel_path: str) -> bool:
        found = super().isdir(kernel_path)
        if found:
            self._note(kernel_path)
        return found

    def listdir(self, kernel_path: str) -> list:
        entries = super().listdir(kernel_path)
        if entries:
            self._note(kernel_path)
            # every entry, as a name at least: discovery counts and matches them (cpuN, nodeN, PCI
            # addresses, interfaces); a file entry is kept empty unless discovery reads it
            for name in entries:
                child = f"{kernel_path.rstrip('/')}/{name}"
                place = self._place(child)
                real = self.path(place)
                if os.path.islink(real):
                    self.links[place] = os.readlink(real)
                elif os.path.isdir(real):
                    self.dirs.add(place)
                else:
                    self.files.add(place)
        return entries

    def realpath(self, kernel_path: str) -> str:
        parts = [p for p in kernel_path.split("/") if p]
        resolved = "/"
        for part in parts:
            candidate = f"{resolved.rstrip('/')}/{part}"
            real = self.path(candidate)
            if os.path.islink(real) and candidate not in self.links:
                self.links[candidate] = os.readlink(real)
            resolved = HostFS.realpath(self, candidate)
        if resolved != "/" and os.path.isdir(self.path(resolved)):
            self.dirs.add(resolved)
        return resolved


def write_capture(fs: RecordingFS, out: str) -> int:
    """Copy what ``fs`` recorded under ``out`` (a new or empty directory); returns the entries written."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise TopologyError(f"{out}: the capture needs a new or empty directory")
    count = 0
    for directory in sorted(fs.dirs):
        os.makedirs(out + directory, exist_ok=True)
        count += 1
    for path, target in sorted(fs.links.items()):
        os.makedirs(os.path.dirname(out + path), exist_ok=True)
        if not os.path.lexists(out + path):
            os.symlink(target, out + path)
            count += 1
    for path in sorted(fs.files - set(fs.links) - fs.dirs):
        os.makedirs(os.path.dirname(out + path), exist_ok=True)
        # what discovery read, as it read it; a file only listed is read now, and one that cannot be
        # read (a down link's speed) is copied empty: it reads as unknown
        data = fs.texts[path] if path in fs.texts else HostFS.read_attr(fs, path)
        with open(out + path, "w", encoding="utf-8") as handle:
            handle.write(data or "")
        count += 1
    return count

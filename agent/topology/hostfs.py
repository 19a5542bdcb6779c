"""One root-prefixed view of the host's kernel filesystems.

Every kernel path Tidal reads goes through a ``HostFS(root)``: ``"/"`` on the
live host, a captured tree in tests (nri-plugins' ``DiscoverSystemAt(root)``,
koordlet's injectable ``SysRootDir``). Paths are given as absolute kernel
paths (``"/sys/devices/system/cpu/online"``) and are mapped under ``root``.

Two kinds of read, because the kernel has two kinds of file:

* ``read``: a structural file (topology, NUMA). Missing -> ``None``; present
  but unreadable (permission, a directory in its place, I/O error) ->
  ``TopologyError`` naming the file, because guessing would be worse.
* ``read_attr``: a device attribute that may legitimately fail to read
  (``speed`` of a link that is down answers EINVAL). Any failure -> ``None``.

Symbolic links inside a captured tree may be absolute (``/sys/devices/...``);
``realpath`` re-roots them so a tree never escapes its root.
"""

from __future__ import annotations

import errno
import os
from typing import List, Optional

from agent.errors import TopologyError


def _read_bytes(path: str) -> bytes:
    """Whole file with raw ``os`` calls: sysfs files are small and discovery
    opens hundreds of them, where ``open()``'s buffered wrapper costs more
    than the read itself."""
    # O_NONBLOCK: a FIFO in a captured tree reads as empty (unknown) instead of blocking forever;
    # regular files ignore the flag, and no fstat per file is paid on trees of hundreds of them
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


class HostFS:
    """Read-only access to ``/sys`` and ``/proc`` under ``root``."""

    __slots__ = ("root", "_prefix")

    def __init__(self, root: str = "/") -> None:
        self.root = os.path.abspath(root)
        self._prefix = "" if self.root == "/" else self.root

    @property
    def is_live(self) -> bool:
        """True when this is the running host (root ``/``)."""
        return self._prefix == ""

    def path(self, kernel_path: str) -> str:
        """The real path of ``kernel_path`` (absolute, e.g. ``/sys/...``)."""
        return self._prefix + kernel_path

    def read(self, kernel_path: str) -> Optional[str]:
        """Text of a structural file; ``None`` if it does not exist."""
        real = self._prefix + kernel_path
        try:
            data = _read_bytes(real)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            return None
        except IsADirectoryError:
            raise TopologyError(f"{real}: is a directory, expected a file") from None
        except OSError as exc:
            raise TopologyError(f"{real}: cannot read: {exc.strerror or exc}") from None
        return data.decode("utf-8", "replace")

    def read_attr(self, kernel_path: str) -> Optional[str]:
        """Text of a device attribute; ``None`` on any failure to read."""
        try:
            return _read_bytes(self._prefix + kernel_path).decode("utf-8", "replace")
        except OSError:
            return None

    def exists(self, kernel_path: str) -> bool:
        return os.path.exists(self._prefix + kernel_path)

    def isdir(self, kernel_path: str) -> bool:
        return os.path.isdir(self._prefix + kernel_path)

    def listdir(self, kernel_path: str) -> List[str]:
        """Sorted entries of a directory; ``[]`` if it does not exist."""
        real = self._prefix + kernel_path
        try:
            return sorted(os.listdir(real))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            if exc.errno == errno.EACCES:
                raise TopologyError(f"{real}: cannot list: permission denied") from None
            raise TopologyError(f"{real}: cannot list: {exc.strerror or exc}") from None

    def realpath(self, kernel_path: str) -> str:
        """Resolve symlinks inside the root; returns a kernel path.

        Relative links resolve as the kernel wrote them; absolute ones are
        re-rooted. At most 40 hops, like the kernel's own limit.
        """
        parts = [p for p in kernel_path.split("/") if p]
        resolved: List[str] = []
        hops = 0
        while parts:
            part = parts.pop(0)
            if part == ".":
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = "/" + "/".join(resolved + [part])
            real = self._prefix + candidate
            if os.path.islink(real):
                hops += 1
                if hops > 40:
                    raise TopologyError(f"{real}: too many levels of symbolic links")
                target = os.readlink(real)
                if target.startswith("/"):
                    resolved = []
                parts = [p for p in target.split("/") if p] + parts
            else:
                resolved.append(part)
        return "/" + "/".join(resolved)

    def __repr__(self) -> str:
        return f"HostFS({self.root!r})"

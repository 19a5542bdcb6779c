"""Removing the cgroup trees a test made on the host's cgroupfs."""

from __future__ import annotations

import errno
import os
import time


def remove_cgroup_tree(path: str, timeout: float = 5.0) -> bool:
    """rmdir ``path`` and everything under it, deepest first. A cgroup whose last task was just killed
    can refuse with EBUSY for a moment while the kernel finishes the task's exit, so EBUSY is retried
    until ``timeout``; a cgroup that still has tasks then stays. Returns whether the tree is gone."""
    deadline = time.monotonic() + timeout
    while True:
        busy = False
        if not os.path.isdir(path):
            return True
        for parent, dirs, _files in os.walk(path, topdown=False):
            for directory in [os.path.join(parent, name) for name in dirs] + ([path] if parent == path else []):
                try:
                    os.rmdir(directory)
                except FileNotFoundError:
                    pass
                except OSError as error:
                    busy = busy or error.errno == errno.EBUSY
        if not os.path.isdir(path):
            return True
        if not busy or time.monotonic() >= deadline:
            return False
        time.sleep(0.1)

"""Files in the agent's state directory: the one atomic write, and reads that treat them as input.

``write_atomic``: a temporary file in the same directory, written whole,
fsynced, renamed over the target, then the directory fsynced, so a crash at
any instant leaves the old file or the new one, never a torn one, and the
rename survives a power loss. Every state file goes through it (checkpoint,
node state, usage history, saved originals).

``read_regular``: a state file is read only if it is a regular file; a FIFO
would block the agent's start forever, a directory or device is nonsense.
``keep_bad_copy``: a file that cannot be used is renamed to ``<name>.bad-N``
(kept for the operator, never deleted) before the agent carries on without it.

``load_json``: THE way a state file is read. Whatever its content (not a
regular file, unreadable, not JSON, numbers or nesting over the bounds of
``contracts.jsonbound``, or refused by the file's own parser), it never stops
the agent: the file is kept aside and the caller carries on without it, with
one warning line that says what that means.

``check_state_dir``: the directory itself must be root's and writable by
nobody else; a local user who could plant a file there (a directory named
``node.json``, a checkpoint of their choosing) would decide the next start.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from typing import Any, Callable, Optional, Tuple, TypeVar

from agent.errors import StateError
from contracts.jsonbound import BoundError, loads_bounded

T = TypeVar("T")

_MAX_STATE_FILE = 64 * 1024 * 1024  # no state file of a node is anywhere near this


class NotRegular(StateError):
    """A state file that is a FIFO, directory, device or symlink: refused (the agent does not start)."""


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise StateError(f"{path}: cannot write: {exc.strerror or exc}") from None


def write_json(path: str, doc: Any, mode: int = 0o600) -> None:
    write_atomic(path, json.dumps(doc, sort_keys=True).encode(), mode)


def read_regular(path: str) -> Optional[bytes]:
    """The file's bytes; ``None`` when it does not exist; ``StateError`` when it is not a
    regular file, is too large or cannot be read (opened without blocking: a FIFO never hangs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            raise NotRegular(f"{path}: not a regular file") from None
        raise StateError(f"{path}: cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegular(f"{path}: not a regular file; move it away to let the agent start")
        if info.st_size > _MAX_STATE_FILE:
            raise StateError(f"{path}: {info.st_size} bytes, more than any state file should hold")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise StateError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def keep_bad_copy(path: str) -> Optional[str]:
    """Rename an unusable state file to ``<path>.bad-N`` (the first free N); its new name, or None."""
    for n in range(0, 1000):
        target = f"{path}.bad-{n}"
        if not os.path.lexists(target):
            try:
                os.rename(path, target)
                return target
            except OSError:
                return None
    return None


class Unusable(StateError):
    """A state file whose content cannot be used (the message says why, in one line)."""


def read_json(path: str, max_depth: int = 8) -> Optional[Any]:
    """The decoded JSON of a state file; None when there is none; ``Unusable`` for anything else."""
    try:
        raw = read_regular(path)
    except StateError as exc:
        raise Unusable(str(exc).split(": ", 1)[-1]) from None
    if raw is None:
        return None
    try:
        return loads_bounded(raw, max_depth=max_depth)
    except BoundError as exc:
        raise Unusable(f"not JSON ({exc})") from None


def load_json(path: str, parse: Callable[[Any], T], consequence: str,
              max_depth: int = 8) -> Tuple[Optional[T], Optional[str]]:
    """``(parse(doc), None)``; ``(None, None)`` when there is no file; ``(None, warning)`` when it was
    unusable, the file then kept as ``<path>.bad-N``. ``parse`` raises ValueError (or TypeError,
    KeyError) naming what is wrong; ``consequence`` finishes the warning (what the agent does now)."""
    try:
        doc = read_json(path, max_depth)
        if doc is None:
            return None, None
        return parse(doc), None
    except (Unusable, ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        kept = keep_bad_copy(path)
        return None, f"{path} unusable ({str(exc)[:300]}); kept as {kept}; {consequence}"


def check_state_dir(path: str) -> None:
    """Refuse (``StateError``, one line) a state directory that is a symlink, is not a directory, or that
    a user other than the agent's own may write (its owner, or its group or others' write bits)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise StateError(f"--state-dir {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise StateError(f"--state-dir {path}: not a directory (a symlink is refused too)")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid() or mode & 0o022:
        raise StateError(f"--state-dir {path}: writable by others (owner uid {info.st_uid}, mode {mode:04o}); "
                         f"the agent's state must be its own: chown {os.geteuid()} and chmod go-w (e.g. 0700)")

"""Who may do what through the agent's API.

The agent moves processes between cgroups and kills them (evictions,
lending): whoever drives it can stop any process on the node. So:

| caller                                         | may                                                     |
|------------------------------------------------|---------------------------------------------------------|
| the unix socket, uid 0 (``SO_PEERCRED``)       | everything                                              |
| the unix socket, another uid (``--socket-group``) | read; admit workloads (owned by that uid, at most ``--max-workloads-per-user``, never ``system_cores``); release and attach only its own; attach only pids it owns; never lend or take back the node |
| the plugin socket (``--plugin-socket``), the NRI plugin's uid (``--plugin-uid``) or root | read only; it alone (and root) may say it is registered with the runtime (``X-Tidal-NRI``) |
| loopback TCP with ``Authorization: Bearer <token>`` (``--tcp-token-file``) | everything          |
| loopback TCP without it                        | read-only: health, capacity, metrics, status, openapi.json |

Pods are workloads of the Kubernetes source, named ``pod/<uid>``: a name the
local API refuses, so no caller can take a pod's name (and its cpus) first.

The socket is mode 0600 (root only) unless ``--socket-group`` opens it to
one group (0660); its file appears only once the agent listens, with that
mode and group: a client that sees it can connect. The token file must be a
regular file owned by root and readable by nobody else; tokens are compared
in constant time.
"""

from __future__ import annotations

import hmac
import os
import stat
from dataclasses import dataclass
from typing import Optional, Sequence

from agent.errors import Forbidden, TidalError  # noqa: F401 - Forbidden is raised here

TCP_READ_ONLY = (("GET", ("health",)), ("GET", ("status",)), ("GET", ("capacity",)), ("GET", ("metrics",)),
                 ("GET", ("openapi.json",)))
MIN_TOKEN = 16


@dataclass(frozen=True)
class Caller:
    via: str  # "unix", "plugin" (the NRI plugin's socket) or "tcp"
    uid: Optional[int] = None  # the peer's uid (SO_PEERCRED; on TCP the kernel's socket table, when found)
    token_ok: bool = False  # TCP: a valid bearer token was sent

    @property
    def is_root(self) -> bool:
        return (self.via == "unix" and self.uid == 0) or (self.via == "tcp" and self.token_ok)

    @property
    def is_plugin(self) -> bool:
        """The NRI plugin: a peer of the plugin socket (only its uid and root can connect there)."""
        return self.via == "plugin"

    @property
    def may_report_runtime(self) -> bool:
        """May this caller say the NRI plugin is registered with the runtime (``X-Tidal-NRI``)?"""
        return self.is_plugin or (self.via == "unix" and self.uid == 0)

    def describe(self) -> str:
        if self.via == "plugin":
            return "the NRI plugin"
        return f"uid {self.uid}" if self.via == "unix" else "an unauthenticated TCP client"


def check(caller: Caller, method: str, route: Sequence[str]) -> None:
    """Raise ``Forbidden`` when ``caller`` may not call ``method route`` at all (``route`` without
    the ``v1`` prefix; ``("metrics",)`` for /metrics). Ownership checks come later, per workload."""
    if caller.is_root:
        return
    if caller.is_plugin:
        if method == "GET":
            return
        raise Forbidden(f"{method} /{'/'.join(route)}: the plugin socket is read-only")
    if caller.via == "tcp":
        if (method, tuple(route)) in TCP_READ_ONLY:
            return
        raise Forbidden(f"{method} /{'/'.join(route)}: the TCP port is read-only without a token "
                        f"(the agent's --tcp-token-file)")
    if method == "GET":
        return
    if tuple(route[:1]) == ("node",):
        raise Forbidden(f"{caller.describe()} may not change the node's lending state (root only)")
    if tuple(route[:1]) == ("offline",):
        raise Forbidden(f"{caller.describe()} may not move processes into offline systems' cgroups (root only)")


def check_admit(owner: Optional[int], qos: str, owned: int, limit: int) -> None:
    """May the uid ``owner`` (None: root, or the token holder) admit one more workload of level
    ``qos``, holding ``owned`` already? Raises ``Forbidden`` naming the rule."""
    if owner is None:
        return
    if qos == "system_cores":
        raise Forbidden(f"uid {owner} may not admit system_cores workloads (root only: they run beside the "
                        f"agent on the reserved cpus)")
    if owned >= limit:
        raise Forbidden(f"uid {owner} holds {owned} workloads, the most one user may (the agent's "
                        f"--max-workloads-per-user {limit})")


def may_touch(caller: Caller, owner: Optional[int]) -> bool:
    """May ``caller`` release or attach to a workload owned by ``owner`` (None: root's)?"""
    return caller.is_root or (owner is not None and caller.uid == owner)


def pid_owner(pid: int, proc: str = "/proc") -> Optional[int]:
    """The uid that owns process ``pid`` (its /proc directory), or None if there is no such process."""
    try:
        return os.stat(f"{proc}/{pid}").st_uid
    except OSError:
        return None


def read_token(path: str) -> str:
    """The bearer token from ``path``: a regular file owned by root, not readable by others."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise TidalError(f"--tcp-token-file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TidalError(f"--tcp-token-file {path}: not a regular file")
        if info.st_uid != 0 or info.st_mode & 0o077:
            raise TidalError(f"--tcp-token-file {path}: must be owned by root with mode 0600 or 0400 "
                             f"(it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})")
        token = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    if len(token) < MIN_TOKEN or any(c.isspace() for c in token):
        raise TidalError(f"--tcp-token-file {path}: the token must be at least {MIN_TOKEN} characters "
                         f"without whitespace (e.g. `openssl rand -hex 32`)")
    return token


def token_matches(header: Optional[str], token: Optional[str]) -> bool:
    if not token or not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())

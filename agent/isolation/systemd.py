"""systemd's units, through its D-Bus API: the cpus of the host's own units, which are systemd's to set.

Tidal's tree and the kubelet's pods are written through the Reconciler; ``system.slice`` (journald,
containerd, monitoring agents, Tidal's own unit), ``user.slice`` (operators' shells) and ``init.scope``
(systemd) belong to systemd, which rewrites their cgroups on its own schedule (``daemon-reload``, a unit
start). Writing their ``cpuset.cpus`` behind its back would be undone; asking systemd (``AllowedCPUs=``,
as ``systemctl set-property --runtime`` does) is the road that lasts.

The protocol is jeepney's (a maintained pure-Python D-Bus implementation), on the system bus. Every call
has a timeout; a failure is ``SystemdError`` with one line.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

from agent.errors import TidalError

BUS_NAME = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
# the interface that carries a unit's cgroup properties, by the unit's type
INTERFACES = {"slice": "org.freedesktop.systemd1.Slice", "scope": "org.freedesktop.systemd1.Scope",
              "service": "org.freedesktop.systemd1.Service"}
MAX_CPUS = 8192  # the kernel's NR_CPUS ceiling: a bigger mask is not a cpu set


class SystemdError(TidalError):
    """systemd's bus could not be reached, or it refused a call (one line)."""


def unit_type(unit: str) -> str:
    """``slice``, ``scope`` or ``service``; ValueError for any other name (Tidal sets no other unit's cpus)."""
    name, dot, kind = unit.rpartition(".")
    if not dot or not name or kind not in INTERFACES or "/" in unit or len(unit) > 255:
        raise ValueError(f"{unit!r}: not a systemd slice, scope or service name")
    return kind


def cpus_to_mask(cpus: Iterable[int]) -> bytes:
    """systemd's D-Bus form of a cpu set: bytes, cpu ``n`` as bit ``n % 8`` of byte ``n // 8``."""
    wanted = sorted(set(cpus))
    if wanted and (wanted[0] < 0 or wanted[-1] >= MAX_CPUS):
        raise ValueError(f"cpu {wanted[0] if wanted[0] < 0 else wanted[-1]} out of range")
    mask = bytearray((wanted[-1] // 8 + 1) if wanted else 0)
    for cpu in wanted:
        mask[cpu // 8] |= 1 << (cpu % 8)
    return bytes(mask)


def mask_to_cpus(mask: bytes) -> List[int]:
    if len(mask) > MAX_CPUS // 8:
        raise ValueError(f"a cpu mask of {len(mask)} bytes")
    return [i * 8 + bit for i, byte in enumerate(mask) for bit in range(8) if byte >> bit & 1]


class SystemdUnits:
    """A connection to systemd on the system bus (opened at the first call, reopened after a failure)."""

    def __init__(self, bus: str = "SYSTEM", timeout: float = 5.0) -> None:
        self.bus, self.timeout = bus, timeout
        self._conn = None

    def _call(self, path: str, interface: str, method: str, signature: Optional[str] = None, body=()):
        from jeepney import DBusAddress, HeaderFields, MessageType, new_method_call
        from jeepney.io.blocking import open_dbus_connection

        try:
            if self._conn is None:
                self._conn = open_dbus_connection(bus=self.bus)
            message = new_method_call(DBusAddress(path, bus_name=BUS_NAME, interface=interface), method,
                                      signature, body)
            reply = self._conn.send_and_get_reply(message, timeout=self.timeout)
        except (OSError, TimeoutError, KeyError, ValueError) as exc:
            self.close()
            raise SystemdError(f"systemd's bus ({self.bus.lower()}): {exc.__class__.__name__}: {exc}") from None
        if reply.header.message_type == MessageType.error:
            name = reply.header.fields.get(HeaderFields.error_name, "error")
            text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
            raise SystemdError(f"systemd refused {method}: {name}: {text}".rstrip(": "))
        return reply.body

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
            self._conn = None

    def allowed_cpus(self, unit: str) -> List[int]:
        """The unit's ``AllowedCPUs=`` (empty: not set, every cpu). The unit is loaded if it is not."""
        kind = unit_type(unit)
        (path,) = self._call(MANAGER_PATH, MANAGER, "LoadUnit", "s", (unit,))
        (value,) = self._call(path, "org.freedesktop.DBus.Properties", "Get", "ss", (INTERFACES[kind], "AllowedCPUs"))
        signature, mask = value
        if signature != "ay":
            raise SystemdError(f"{unit}: AllowedCPUs came as {signature!r}, not a byte array")
        return mask_to_cpus(bytes(mask))

    def set_allowed_cpus(self, unit: str, cpus: Iterable[int]) -> None:
        """``AllowedCPUs=`` of the unit until the next boot (``--runtime``); no cpus: every cpu."""
        unit_type(unit)
        self._call(MANAGER_PATH, MANAGER, "SetUnitProperties", "sba(sv)",
                   (unit, True, [("AllowedCPUs", ("ay", cpus_to_mask(cpus)))]))

"""systemd's units, through its D-Bus API: the cpus of the host's own units, which are systemd's to set.

Tidal's tree and the kubelet's pods are written through the Reconciler; ``system.slice`` (journald,
containerd, monitoring agents, Tidal's own unit), ``user.slice`` (operators' shells) and ``init.scope``
(systemd) belong to systemd, which rewrites their cgroups on its own schedule (``daemon-reload``, a unit
start). Writing their ``cpuset.cpus`` behind its back would be undone; asking systemd (``AllowedCPUs=``,
as ``systemctl set-property --runtime`` does) is the road that lasts.

The same holds for the kubelet's own units under its systemd cgroup driver: a pod's slice
(``kubepods-<qos>-pod<uid>.slice``) and the QoS classes' slices are transient units, and ``systemctl
daemon-reload`` writes every unit's properties to its cgroup again. A value Tidal wrote only to the file
(a reclaimed pod's ``cpu.idle``, its quota and ``memory.high``, online's ``memory.low``) was put back to the
unit's and repaired by Tidal in turn (16 times in 180 s, make test-systemd-kubelet). So the Reconciler also
asks systemd to hold them (``cgroup_properties``, ``UnitProperties``): the unit then says what the file says.

The protocol is jeepney's (a maintained pure-Python D-Bus implementation), on the system bus. Every call
has a timeout; a failure is ``SystemdError`` with one line.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from agent.errors import TidalError

BUS_NAME = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
# the interface that carries a unit's cgroup properties, by the unit's type
INTERFACES = {"slice": "org.freedesktop.systemd1.Slice", "scope": "org.freedesktop.systemd1.Scope",
              "service": "org.freedesktop.systemd1.Service"}
# the unit properties Tidal holds, all D-Bus "t" (uint64): systemd's "infinity" (and "not set" for CPUWeight)
INFINITY = (1 << 64) - 1
CPU_WEIGHT_IDLE = 0  # CPUWeight=idle (systemd >= 252): cpu.idle=1, the weight left alone
DEFAULT_PERIOD_US = 100_000  # systemd's cpu.max period when CPUQuotaPeriodSec= is not set
HELD = ("CPUWeight", "CPUQuotaPerSecUSec", "CPUQuotaPeriodUSec", "MemoryLow", "MemoryHigh")
MAX_CPUS = 8192  # the kernel's NR_CPUS ceiling: a bigger mask is not a cpu set


class SystemdError(TidalError):
    """systemd's bus could not be reached, or it refused a call (one line)."""


class SystemdRefused(SystemdError):
    """systemd answered, with an error (a unit that is gone, a value it does not take): that call alone failed."""


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


def is_unit(name: str) -> bool:
    try:
        unit_type(name)
    except ValueError:
        return False
    return True


def _bytes(text: str) -> int:
    return INFINITY if text == "max" else int(text)


def cgroup_properties(file: str, text: str) -> List[Tuple[str, int]]:
    """The unit properties that make systemd write ``text`` to cgroup v2 file ``file`` itself: ``[]`` for a
    file it has no property for (cpusets: a container's scope gets them from the runtime; ``io.max``:
    systemd names devices by path), or for a value it cannot say (``cpu.idle`` 0: the weight says it).
    ValueError for a value that is not the file's."""
    text = text.strip()
    if file == "cpu.idle":
        return [("CPUWeight", CPU_WEIGHT_IDLE)] if text == "1" else []
    if file == "cpu.weight":
        return [("CPUWeight", int(text))]
    if file == "cpu.max":
        quota, _, period = text.partition(" ")
        period_us = int(period or DEFAULT_PERIOD_US)
        if period_us <= 0:
            raise ValueError(f"cpu.max {text!r}: a period of {period_us}")
        # systemd writes quota_per_sec * period / 1 s: exact for Tidal's 100 ms period (10 µs steps)
        held = [("CPUQuotaPerSecUSec", INFINITY if quota == "max" else int(quota) * 1_000_000 // period_us)]
        return held + ([("CPUQuotaPeriodUSec", period_us)] if period_us != DEFAULT_PERIOD_US else [])
    if file in ("memory.low", "memory.high"):
        return [("MemoryLow" if file == "memory.low" else "MemoryHigh", _bytes(text))]
    return []


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
            raise SystemdRefused(f"systemd refused {method}: {name}: {text}".rstrip(": "))
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

    def get_properties(self, unit: str, names: Sequence[str]) -> Dict[str, int]:
        """The unit's current values of ``names`` (uint64 properties of ``HELD``)."""
        kind = unit_type(unit)
        (path,) = self._call(MANAGER_PATH, MANAGER, "LoadUnit", "s", (unit,))
        values = {}
        for name in names:
            (value,) = self._call(path, "org.freedesktop.DBus.Properties", "Get", "ss", (INTERFACES[kind], name))
            signature, number = value
            if signature != "t":
                raise SystemdError(f"{unit}: {name} came as {signature!r}, not a uint64")
            values[name] = int(number)
        return values

    def set_properties(self, unit: str, values: Sequence[Tuple[str, int]]) -> None:
        """uint64 properties of the unit until it stops or the host reboots (``--runtime``)."""
        unit_type(unit)
        self._call(MANAGER_PATH, MANAGER, "SetUnitProperties", "sba(sv)",
                   (unit, True, [(name, ("t", int(value))) for name, value in values]))


class UnitProperties:
    """What the Reconciler asks of systemd for others' units: ``hold`` a cgroup file's value as the unit's
    property (its value before, for revert, in the result), ``restore`` saved ones. After the bus failed
    (unreachable, no answer in time) every call is refused for ``RETRY_S`` with the same ``SystemdError``: a
    pass of the Reconciler never waits on a dead bus more than once. A refusal by systemd (a unit the kubelet
    just removed) is that call's alone."""

    RETRY_S = 30.0

    def __init__(self, units: Optional[SystemdUnits] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.units = units or SystemdUnits()
        self.clock = clock
        self._failed: Optional[Tuple[float, str]] = None

    def _guard(self) -> None:
        if self._failed is not None:
            since, reason = self._failed
            if self.clock() - since < self.RETRY_S:
                raise SystemdError(reason)
            self._failed = None

    def _run(self, action):
        self._guard()
        try:
            return action()
        except SystemdRefused:
            raise
        except SystemdError as exc:
            self._failed = (self.clock(), str(exc))
            raise

    def hold(self, unit: str, values: Sequence[Tuple[str, int]], saved: Iterable[str]) -> Dict[str, int]:
        """Set ``values`` on ``unit``; the values before of those not in ``saved`` (already kept)."""
        kept = set(saved)
        before = [name for name, _ in values if name not in kept]
        originals = self._run(lambda: self.units.get_properties(unit, before)) if before else {}
        self._run(lambda: self.units.set_properties(unit, values))
        return originals

    def restore(self, unit: str, values: Sequence[Tuple[str, int]]) -> None:
        self._run(lambda: self.units.set_properties(unit, values))

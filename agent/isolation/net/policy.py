"""What the network shaper is asked to do, checked before anything is built.

Model. Each managed NIC has a *role* (``online`` NIC, optional ``offline`` NIC)
and the rate its link really carries. On each NIC Tidal owns one HTB tree
(handle ``1a1d:``, chosen so that Tidal's tree is recognisable on sight)::

    1a1d:1   link    rate = ceil = shaped rate (the link rate less a small headroom,
                     so the queue forms here, where priorities apply, and not in
                     the NIC or the switch behind it)
    1a1d:10  online  prio 0, guaranteed the rest, borrows up to the shaped rate
    1a1d:30  system  prio 1, a small guarantee, borrows up to the shaped rate
    1a1d:20  offline prio 2, a guaranteed floor; its ceiling floats:
                     shaped rate - recent online peak - margin

Offline traffic is that of sockets made by tasks in the reclaimed tree; the
classifier (``classify.py``) sets its packets' priority to ``1a1d:20`` (HTB
takes a packet whose ``skb->priority`` names one of its leaf classes straight
into it) and its mark, which policy routing (``routing.py``) sends through the
offline NIC. Rates are bits per second throughout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional

from agent.errors import TidalError


class NetError(TidalError):
    """A NIC, a rate or a role is wrong, or the kernel refused part of the set-up."""


HTB_MAJOR = 0x1A1D
QDISC_HANDLE = HTB_MAJOR << 16
CLASS_LINK = QDISC_HANDLE | 0x1
CLASS_ONLINE = QDISC_HANDLE | 0x10
CLASS_OFFLINE = QDISC_HANDLE | 0x20
CLASS_SYSTEM = QDISC_HANDLE | 0x30
CLASS_NAMES = {CLASS_LINK: "link", CLASS_ONLINE: "online", CLASS_OFFLINE: "offline", CLASS_SYSTEM: "system"}
FILTER_PRIO = 0x1A1D  # tc filters Tidal adds carry this priority: it is their owner tag
RT_PROTO = 211  # routes and rules Tidal adds carry this protocol number: their owner tag
IFB_PREFIX = "tdlifb"  # + the NIC's ifindex: the IFB device taking a NIC's ingress
# Offline connections leave with source ports in 61440-65535 (NAT), so their
# replies can be told apart on ingress, where no socket is known yet.
OFFLINE_PORT_MASK = 0xF000

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)\s*$", re.I)
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def parse_rate(text: str) -> int:
    """``"100mbit"`` -> 100_000_000 (bits/s); tc's units, where ``bps`` means bytes."""
    match = _RATE.match(str(text))
    if not match:
        raise NetError(f"rate {text!r}: expected a number and a unit (bit, kbit, mbit, gbit; bps for bytes), "
                       f"like 10gbit")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise NetError(f"rate {text!r}: must be above zero")
    return value


def format_rate(bits: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g}{unit}"
    return f"{bits:.0f}bit"


@dataclass(frozen=True)
class NicRole:
    name: str
    rate: int  # bits/s the link carries
    gateway: Optional[str] = None  # offline NIC: next hop of the offline table (default: the NIC's own default route)


def parse_nic(text: str, gateway: Optional[str] = None) -> NicRole:
    """``"eth1:10gbit"`` -> NicRole."""
    name, sep, rate = str(text).rpartition(":")
    if not sep or not name:
        raise NetError(f"NIC {text!r}: expected NAME:RATE, like eth0:10gbit")
    return NicRole(name, parse_rate(rate), gateway)


@dataclass(frozen=True)
class NetConfig:
    online: NicRole
    offline: Optional[NicRole] = None
    netns: Optional[str] = None  # a named network namespace (/run/netns/NAME) instead of the agent's own
    headroom: float = 0.02  # the root class is shaped this much below the link, so the queue stays in HTB
    margin: float = 0.01  # of the link: kept free above online's recent peak when sizing offline's ceiling
    offline_floor: float = 0.05  # of the link: offline's guarantee, whatever online does
    system_share: float = 0.02  # of the link: the system class's guarantee
    burst_us: int = 100  # HTB bursts: this long at a class's rate (at least two full frames): what HTB
    # sends back to back queues in the NIC or the switch behind it, ahead of online's next packet
    window: float = 5.0  # seconds of online rate samples whose peak sizes the offline ceiling
    ingress: bool = True  # shape incoming traffic too (through an IFB device per NIC)
    mark: int = 0x00110000  # packet mark of offline traffic (within mask)
    mask: int = 0x00FF0000  # the mark bits Tidal owns; other bits are left as they are
    table: int = 211  # routing table of offline traffic
    rule_priority: int = 9211

    def nics(self) -> Dict[str, NicRole]:
        roles = {"online": self.online}
        if self.offline is not None:
            roles["offline"] = self.offline
        return roles

    def check(self) -> None:
        """Checks that need no kernel: roles, fractions, mark inside its mask."""
        if self.offline is not None and self.offline.name == self.online.name:
            raise NetError(f"NIC {self.online.name!r} is given both the online and the offline role; "
                           f"give the offline role to another NIC, or leave it out to shape one NIC")
        for label, value in (("headroom", self.headroom), ("margin", self.margin),
                             ("offline_floor", self.offline_floor), ("system_share", self.system_share)):
            if not 0 <= value < 0.5:
                raise NetError(f"{label} {value}: must be a fraction of the link in [0, 0.5)")
        if self.offline_floor + self.system_share + self.headroom >= 0.9:
            raise NetError("offline_floor + system_share + headroom leave online less than 10% of the link")
        if self.mark & ~self.mask or not self.mark:
            raise NetError(f"mark {self.mark:#x} must be non-zero and inside mask {self.mask:#x}")
        if not 1 <= self.table <= 2 ** 31 - 1 or self.table in (253, 254, 255):
            raise NetError(f"table {self.table}: must be a free routing table (not default/main/local)")


@dataclass
class ClassRates:
    """One NIC's class rates (bits/s)."""

    shaped: int
    online: int
    system: int
    offline_floor: int
    offline_ceil: int
    burst_us: int = 100

    def burst(self, rate: float) -> int:
        """Bytes a class may send back to back. Too small and the timer cannot keep up with
        the rate (the class falls short of it); too large and a burst queues in the NIC."""
        return max(3028, int(rate / 8 * self.burst_us / 1e6))

    @classmethod
    def plan(cls, config: NetConfig, link_rate: int) -> "ClassRates":
        shaped = int(link_rate * (1 - config.headroom))
        floor = max(8_000, int(link_rate * config.offline_floor))
        system = max(8_000, int(link_rate * config.system_share))
        online = max(8_000, shaped - floor - system)
        return cls(shaped, online, system, floor, shaped, config.burst_us)

    def offline_ceiling(self, config: NetConfig, link_rate: int, online_peak: float) -> int:
        """Shaped rate - online's recent peak - margin, never below the floor."""
        ceil = self.shaped - online_peak - link_rate * config.margin
        return int(min(self.shaped, max(self.offline_floor, ceil)))

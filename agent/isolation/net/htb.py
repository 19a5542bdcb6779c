"""Tidal's HTB tree on a NIC (egress) or on its IFB device (ingress).

See ``policy.py`` for the classes. The tree is Tidal's when the root qdisc is
an HTB with handle ``1a1d:``; a restart adopts such a tree (``replace`` is
idempotent) and a root qdisc anyone else set up (a non-zero handle that is not
ours) is refused rather than replaced. Deleting Tidal's root qdisc gives the
NIC back its kernel default (``noqueue``, ``mq``, ``pfifo_fast``...), which
the kernel recreates by itself.

Ingress: an ``ingress`` qdisc on the NIC whose one filter (priority
``FILTER_PRIO``) redirects every packet to the IFB device ``tdlifb<ifindex>``,
whose egress carries the same classes. On ingress no socket is known yet, so
offline packets are recognised by their destination port: offline connections
leave with source ports in 61440-65535 (``classify.py`` NATs them there), and
their replies come back to those ports. The offline NIC's IFB defaults to the
offline class (everything arriving there is offline traffic's).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from agent.isolation.net.netlink import Netlink
from agent.isolation.net.policy import (
    CLASS_LINK, CLASS_NAMES, CLASS_OFFLINE, CLASS_ONLINE, CLASS_SYSTEM, FILTER_PRIO, IFB_PREFIX,
    OFFLINE_PORT_MASK, QDISC_HANDLE, ClassRates, NetError,
)

INGRESS_HANDLE = 0xFFFF0000
ETH_P_ALL = 0x0003
ETH_P_IP = 0x0800
IPPROTO_TCP, IPPROTO_UDP = 6, 17


def _bit(rate: float) -> str:
    return f"{max(8, int(rate))}bit"


def root_qdisc(nl: Netlink, index: int) -> Optional[Dict[str, Any]]:
    for msg in nl.ipr.get_qdiscs(index):
        if msg["parent"] == 0xFFFFFFFF:
            return {"kind": msg.get_attr("TCA_KIND"), "handle": msg["handle"]}
    return None


def is_ours(qdisc: Optional[Dict[str, Any]]) -> bool:
    return bool(qdisc) and qdisc["kind"] == "htb" and qdisc["handle"] == QDISC_HANDLE


def check_free(nl: Netlink, index: int, name: str) -> None:
    """Refuse a NIC whose root qdisc someone else configured."""
    qdisc = root_qdisc(nl, index)
    if qdisc and qdisc["handle"] != 0 and not is_ours(qdisc):
        raise NetError(f"NIC {name!r} already has a root qdisc ({qdisc['kind']} {qdisc['handle'] >> 16:x}:) "
                       f"that Tidal did not make; remove it or leave this NIC out")


def build(nl: Netlink, index: int, rates: ClassRates, default_class: int) -> None:
    """Create or adopt the tree with these rates (idempotent)."""
    tc = nl.ipr.tc
    qdisc = root_qdisc(nl, index)
    if is_ours(qdisc):
        # adopt: the qdisc's default class cannot be changed in place, so only recreate on mismatch
        current = _default_minor(nl, index)
        if current is not None and current != (default_class & 0xFFFF):
            tc("del", "htb", index, QDISC_HANDLE)
            qdisc = None
    if not is_ours(qdisc):
        tc("replace", "htb", index, QDISC_HANDLE, default=default_class & 0xFFFF)
    _class(tc, "replace-class", index, CLASS_LINK, QDISC_HANDLE, rates, rates.shaped, rates.shaped, 0)
    _class(tc, "replace-class", index, CLASS_ONLINE, CLASS_LINK, rates, rates.online, rates.shaped, 0)
    _class(tc, "replace-class", index, CLASS_SYSTEM, CLASS_LINK, rates, rates.system, rates.shaped, 1)
    _class(tc, "replace-class", index, CLASS_OFFLINE, CLASS_LINK, rates, rates.offline_floor,
           max(rates.offline_ceil, rates.offline_floor), 2)


def _class(tc, verb: str, index: int, handle: int, parent: int, rates: ClassRates, rate: int, ceil: int,
           prio: int) -> None:
    tc(verb, "htb", index, handle, parent=parent, rate=_bit(rate), ceil=_bit(ceil), prio=prio,
       burst=rates.burst(rate), cburst=rates.burst(ceil))


def _default_minor(nl: Netlink, index: int) -> Optional[int]:
    for msg in nl.ipr.get_qdiscs(index):
        if msg["handle"] == QDISC_HANDLE:
            init = (msg.get_attr("TCA_OPTIONS") or {}).get_attr("TCA_HTB_INIT") if msg.get_attr("TCA_OPTIONS") else None
            return init["defcls"] if init else None
    return None


def set_offline_ceil(nl: Netlink, index: int, rates: ClassRates, ceil: int) -> None:
    """Re-rate the offline class in place (``change``): queued packets stay queued."""
    _class(nl.ipr.tc, "change-class", index, CLASS_OFFLINE, CLASS_LINK, rates, rates.offline_floor,
           max(ceil, rates.offline_floor), 2)


def read_classes(nl: Netlink, index: int) -> Dict[str, Dict[str, int]]:
    """Tidal's classes on the device: rate, ceil (bits/s), bytes, packets, drops, overlimits, backlog."""
    out: Dict[str, Dict[str, int]] = {}
    for msg in nl.ipr.get_classes(index):
        name = CLASS_NAMES.get(msg["handle"])
        if name is None or msg.get_attr("TCA_KIND") != "htb":
            continue
        parms = msg.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS")
        rate64 = msg.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_RATE64")
        ceil64 = msg.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_CEIL64")
        stats = msg.get_attr("TCA_STATS2")
        basic = stats.get_attr("TCA_STATS_BASIC") if stats else None
        queue = stats.get_attr("TCA_STATS_QUEUE") if stats else None
        out[name] = {"rate_bps": int(rate64 or parms["rate"]) * 8, "ceil_bps": int(ceil64 or parms["ceil"]) * 8,
                     "bytes": basic["bytes"] if basic else 0, "packets": basic["packets"] if basic else 0,
                     "drops": queue["drops"] if queue else 0, "overlimits": queue["overlimits"] if queue else 0,
                     "backlog": queue["backlog"] if queue else 0}
    return out


def remove(nl: Netlink, index: int) -> bool:
    """Delete Tidal's root qdisc (and so its classes and filters); another's is left alone."""
    if not is_ours(root_qdisc(nl, index)):
        return False
    nl.ipr.tc("del", "htb", index, QDISC_HANDLE)
    return True


# ingress --------------------------------------------------------------------------------
def ifb_name(index: int) -> str:
    return f"{IFB_PREFIX}{index}"


def _ingress_filters(nl: Netlink, index: int):
    try:
        return list(nl.ipr.get_filters(index, parent=INGRESS_HANDLE))
    except Exception:
        return []


def has_ingress(nl: Netlink, index: int) -> bool:
    return any(m["parent"] == 0xFFFFFFF1 for m in nl.ipr.get_qdiscs(index))


def check_ingress_free(nl: Netlink, index: int, name: str) -> None:
    foreign = [m for m in _ingress_filters(nl, index) if (m["info"] >> 16) != FILTER_PRIO]
    if has_ingress(nl, index) and foreign:
        raise NetError(f"NIC {name!r} already has ingress filters that Tidal did not make; "
                       f"remove them or run with ingress shaping off")


def attach_ingress(nl: Netlink, index: int, rates: ClassRates, default_class: int) -> int:
    """IFB device for the NIC's ingress, its HTB tree and the port filters; returns its ifindex."""
    name = ifb_name(index)
    ifb = nl.index(name)
    if ifb is None:
        nl.ipr.link("add", ifname=name, kind="ifb")
        ifb = nl.require(name)
    nl.ipr.link("set", index=ifb, state="up")
    build(nl, ifb, rates, default_class)
    if not any((m["info"] >> 16) == FILTER_PRIO for m in nl.ipr.get_filters(ifb, parent=QDISC_HANDLE)):
        for proto in (IPPROTO_TCP, IPPROTO_UDP):
            # IPv4 with no options: byte 9 is the protocol, bytes 22-23 the destination port
            nl.ipr.tc("add-filter", "u32", ifb, parent=QDISC_HANDLE, prio=FILTER_PRIO, protocol=ETH_P_IP,
                      target=CLASS_OFFLINE, keys=[f"0x{proto << 16:08x}/0x00ff0000+8",
                                                  f"0x{OFFLINE_PORT_MASK:08x}/0x{OFFLINE_PORT_MASK:08x}+20"])
    if not has_ingress(nl, index):
        nl.ipr.tc("add", "ingress", index, INGRESS_HANDLE)
    if not any((m["info"] >> 16) == FILTER_PRIO for m in _ingress_filters(nl, index)):
        nl.ipr.tc("add-filter", "u32", index, parent=INGRESS_HANDLE, prio=FILTER_PRIO, protocol=ETH_P_ALL,
                  target=0, keys=["0x0/0x0+0"],
                  action=[{"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": ifb}])
    return ifb


def detach_ingress(nl: Netlink, index: int) -> bool:
    """Remove Tidal's redirect (and the ingress qdisc if nothing else uses it) and its IFB."""
    removed = False
    if has_ingress(nl, index):
        filters = _ingress_filters(nl, index)
        ours = [m for m in filters if (m["info"] >> 16) == FILTER_PRIO]
        if ours and len(ours) == len(filters):
            nl.ipr.tc("del", "ingress", index, INGRESS_HANDLE)
            removed = True
        elif ours:
            nl.ipr.tc("del-filter", "u32", index, parent=INGRESS_HANDLE, prio=FILTER_PRIO, protocol=ETH_P_ALL)
            removed = True
    ifb = nl.index(ifb_name(index))
    if ifb is not None:
        nl.ipr.link("del", index=ifb)
        removed = True
    return removed

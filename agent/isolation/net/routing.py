"""Policy routing of offline traffic through the offline NIC, with fallback.

One rule, ``fwmark <mark>/<mask> lookup <table>``, and one route in that table,
``default via <gateway> dev <offline NIC>``, both tagged with protocol
``RT_PROTO`` (Tidal's owner tag; ``ip rule``/``ip route`` print it as
``proto 211``). When the offline NIC loses its link the route is taken out of
the table: the lookup then finds nothing there and the kernel goes on to the
next rule (the main table), so offline traffic leaves by the online NIC,
still in its offline class, instead of being blackholed; the route is put back
when the link returns. Connections the NAT had bound to the offline NIC's
address must reconnect after a failover (their replies went to that address).
"""

from __future__ import annotations

import socket
from typing import Dict, List, Optional

from agent.isolation.net.netlink import Netlink
from agent.isolation.net.policy import RT_PROTO, NetConfig


def ensure_rule(nl: Netlink, config: NetConfig) -> None:
    for rule in _our_rules(nl):
        if (rule.get_attr("FRA_FWMARK"), rule.get_attr("FRA_FWMASK"), rule.get_attr("FRA_TABLE"),
                rule.get_attr("FRA_PRIORITY")) == (config.mark, config.mask, config.table, config.rule_priority):
            return
    nl.ipr.rule("add", family=socket.AF_INET, table=config.table, priority=config.rule_priority,
                fwmark=config.mark, fwmask=config.mask, protocol=RT_PROTO)


def _our_rules(nl: Netlink) -> List:
    return [r for r in nl.ipr.get_rules(family=socket.AF_INET) if r.get_attr("FRA_PROTOCOL") == RT_PROTO]


def _our_routes(nl: Netlink, table: int) -> List:
    return [r for r in nl.ipr.get_routes(family=socket.AF_INET, table=table) if r["proto"] == RT_PROTO]


def set_offline_route(nl: Netlink, config: NetConfig, index: int, gateway: Optional[str], up: bool) -> bool:
    """Install (``up``) or withdraw the offline table's default route; True when something changed."""
    present = _our_routes(nl, config.table)
    if not up:
        for route in present:
            _del_route(nl, route)
        return bool(present)
    if any(r.get_attr("RTA_OIF") == index and r.get_attr("RTA_GATEWAY") == gateway for r in present):
        return False
    spec: Dict = {"dst": "0.0.0.0/0", "oif": index, "table": config.table, "proto": RT_PROTO}
    if gateway:
        spec["gateway"] = gateway
    nl.ipr.route("replace", **spec)
    return True


def _del_route(nl: Netlink, route) -> None:
    try:
        nl.ipr.route("del", table=route.get_attr("RTA_TABLE") or route["table"], dst="0.0.0.0/0",
                     proto=RT_PROTO, oif=route.get_attr("RTA_OIF"))
    except Exception:
        pass  # the kernel already dropped it with its link


def offline_route(nl: Netlink, config: NetConfig) -> Optional[Dict]:
    for route in _our_routes(nl, config.table):
        return {"dev_index": route.get_attr("RTA_OIF"), "gateway": route.get_attr("RTA_GATEWAY")}
    return None


def remove(nl: Netlink, config: NetConfig) -> int:
    """Delete every rule and route carrying Tidal's tag (whatever config made them)."""
    removed = 0
    rules = _our_rules(nl)
    tables = {config.table} | {r.get_attr("FRA_TABLE") for r in rules}
    for rule in rules:
        nl.ipr.rule("del", family=socket.AF_INET, priority=rule.get_attr("FRA_PRIORITY"),
                    table=rule.get_attr("FRA_TABLE"), fwmark=rule.get_attr("FRA_FWMARK"),
                    fwmask=rule.get_attr("FRA_FWMASK"), protocol=RT_PROTO)
        removed += 1
    for table in tables:
        for route in _our_routes(nl, table):
            _del_route(nl, route)
            removed += 1
    return removed

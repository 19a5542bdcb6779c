"""The network shaper: builds, adjusts, reports and removes Tidal's traffic set-up.

``setup()`` checks everything first (NICs exist, rates are sane for the link,
no one else's qdiscs are in the way, roles do not overlap) and only then
builds: per NIC the HTB tree (``htb``), its ingress IFB, the classifier
(``classify``) and, with an offline NIC, the policy routing (``routing``). A
failure half-way removes what was built and reports the one cause.

``adjust()`` runs every agent period: it measures online (and system) traffic
per device from the class byte counters, keeps the peak of the last
``window`` seconds, and re-rates the offline class's ceiling to
shaped rate - peak - margin when that moved by more than 1% of the link
(``tc class change``: nothing queued is dropped). It also follows the offline
NIC's link and moves the offline route out of, or back into, its table.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from agent.isolation.net import classify, htb, routing
from agent.isolation.net.netlink import Netlink
from agent.isolation.net.policy import (
    CLASS_OFFLINE, CLASS_ONLINE, ClassRates, NetConfig, NetError, NicRole, format_rate, parse_nic,
)

DEADBAND = 0.01  # of the link: smaller ceiling moves are not worth a netlink call


class _Device:
    """One shaped device: a NIC's egress or its IFB (the NIC's ingress)."""

    def __init__(self, label: str, index: int, rates: ClassRates, link_rate: int) -> None:
        self.label = label
        self.index = index
        self.rates = rates
        self.link_rate = link_rate
        self.samples: Deque[Tuple[float, float]] = collections.deque()  # (time, online bits/s)
        self.last: Optional[Tuple[float, int]] = None  # (time, online+system bytes)
        self.ceil = rates.offline_ceil

    def observe(self, now: float, online_bytes: int, window: float) -> float:
        if self.last is not None and now > self.last[0]:
            rate = max(0, online_bytes - self.last[1]) * 8 / (now - self.last[0])
            self.samples.append((now, rate))
        self.last = (now, online_bytes)
        while self.samples and self.samples[0][0] < now - window:
            self.samples.popleft()
        return max((rate for _, rate in self.samples), default=0.0)


class NetShaper:
    def __init__(self, config: NetConfig, offline_dir: Optional[str] = None, system_dir: Optional[str] = None,
                 cgroup2_root: Optional[str] = None, clock: Callable[[], float] = time.monotonic,
                 echo: Callable[[str], None] = lambda line: None) -> None:
        self.config = config
        self.offline_dir, self.system_dir, self.cgroup2_root = offline_dir, system_dir, cgroup2_root
        self.clock = clock
        self.echo = echo
        self.lock = threading.Lock()
        self.nl: Optional[Netlink] = None
        self.devices: Dict[str, _Device] = {}
        self.nic_index: Dict[str, int] = {}
        self.classifier = classify.Classifier("none", reason="not set up")
        self.offline_gateway: Optional[str] = None
        self.offline_up: Optional[bool] = None
        self.failovers = 0
        self.rerates = 0

    # set-up --------------------------------------------------------------------------------
    def _check(self, nl: Netlink) -> None:
        self.config.check()
        for role, nic in self.config.nics().items():
            index = nl.require(nic.name)
            if nl.link(index)["kind"] == "ifb" or nic.name.startswith(htb.ifb_name(0)[:-1]):
                raise NetError(f"NIC {nic.name!r} is an IFB device; give the real NIC")
            speed = nl.speed_bps(nic.name)
            if speed is not None and nic.rate > speed:
                raise NetError(f"{role} NIC {nic.name!r}: rate {format_rate(nic.rate)} is above its link speed "
                               f"{format_rate(speed)}")
            htb.check_free(nl, index, nic.name)
            if self.config.ingress:
                htb.check_ingress_free(nl, index, nic.name)
            self.nic_index[role] = index

    def setup(self) -> Dict[str, Any]:
        with self.lock:
            nl = Netlink(self.config.netns)
            try:
                self._check(nl)
            except Exception:
                nl.close()
                raise
            self.nl = nl
            try:
                self._build()
            except Exception as exc:
                cause = exc if isinstance(exc, NetError) else NetError(f"{type(exc).__name__}: {exc}")
                try:
                    self._remove()
                finally:
                    self.nl.close()
                    self.nl = None
                raise NetError(f"network set-up failed and was rolled back: {cause}") from None
        return self.status()

    def _build(self) -> None:
        config, nl = self.config, self.nl
        self.classifier = classify.detect(self.offline_dir, self.system_dir, self.cgroup2_root)
        for role, nic in config.nics().items():
            index = self.nic_index[role]
            rates = ClassRates.plan(config, nic.rate)
            htb.build(nl, index, rates, CLASS_ONLINE)
            self.devices[f"{nic.name}"] = _Device(f"{nic.name} egress", index, rates, nic.rate)
            if config.ingress:
                ifb = htb.attach_ingress(nl, index, ClassRates.plan(config, nic.rate),
                                         CLASS_OFFLINE if role == "offline" else CLASS_ONLINE)
                self.devices[htb.ifb_name(index)] = _Device(f"{nic.name} ingress", ifb, ClassRates.plan(config, nic.rate),
                                                           nic.rate)
        classify.apply(config, self.classifier, config.offline.name if config.offline else None,
                       [nic.name for nic in config.nics().values()])
        if config.offline is not None and self.classifier.kind != "none":
            index = self.nic_index["offline"]
            self.offline_gateway = config.offline.gateway or nl.default_gateway(index)
            routing.ensure_rule(nl, config)
            self._follow_offline_link()
        self.echo(f"net: shaping {', '.join(f'{r} {n.name} at {format_rate(n.rate)}' for r, n in config.nics().items())}; "
                  f"classifier {self.classifier.describe()}")

    def _follow_offline_link(self) -> None:
        index = self.nic_index["offline"]
        up = self.nl.is_running(index)
        changed = routing.set_offline_route(self.nl, self.config, index, self.offline_gateway, up)
        if self.offline_up is not None and up != self.offline_up:
            self.failovers += 1
            self.echo(f"net: offline NIC {self.config.offline.name} is {'back' if up else 'down'}; offline traffic "
                      f"now leaves by {self.config.offline.name if up else self.config.online.name}")
        elif changed and not up:
            self.echo(f"net: offline NIC {self.config.offline.name} is down; offline traffic falls back to "
                      f"{self.config.online.name}")
        self.offline_up = up

    # every period ----------------------------------------------------------------------------
    def adjust(self) -> None:
        with self.lock:
            if self.nl is None:
                return
            now = self.clock()
            for device in self.devices.values():
                classes = htb.read_classes(self.nl, device.index)
                if "online" not in classes:
                    continue
                used = classes["online"]["bytes"] + classes.get("system", {}).get("bytes", 0)
                peak = device.observe(now, used, self.config.window)
                ceil = device.rates.offline_ceiling(self.config, device.link_rate, peak)
                if abs(ceil - device.ceil) > DEADBAND * device.link_rate:
                    htb.set_offline_ceil(self.nl, device.index, device.rates, ceil)
                    device.ceil = ceil
                    self.rerates += 1
            if self.config.offline is not None and self.classifier.kind != "none":
                self._follow_offline_link()

    # reporting -------------------------------------------------------------------------------
    def status(self) -> Dict[str, Any]:
        with self.lock:
            if self.nl is None:
                return {"enabled": False}
            config = self.config
            nics: List[Dict[str, Any]] = []
            for role, nic in config.nics().items():
                index = self.nic_index[role]
                entry: Dict[str, Any] = {"name": nic.name, "role": role, "link_bps": nic.rate,
                                         "running": self.nl.is_running(index),
                                         "egress": self._device_status(nic.name)}
                ifb = htb.ifb_name(index)
                if ifb in self.devices:
                    entry["ingress"] = dict(self._device_status(ifb), device=ifb)
                nics.append(entry)
            route = routing.offline_route(self.nl, config) if config.offline else None
            via = None
            if config.offline is not None and self.classifier.kind != "none":
                via = config.offline.name if route else f"{config.online.name} (fallback: {config.offline.name} is down)"
            return {"enabled": True, "netns": config.netns, "classifier": self.classifier.kind,
                    "classifier_detail": self.classifier.describe(),
                    "mark": f"{config.mark:#x}/{config.mask:#x}", "table": config.table,
                    "offline_via": via, "offline_gateway": self.offline_gateway,
                    "failovers": self.failovers, "rerates": self.rerates, "nics": nics}

    def _device_status(self, key: str) -> Dict[str, Any]:
        device = self.devices[key]
        classes = htb.read_classes(self.nl, device.index)
        peak = max((rate for _, rate in device.samples), default=0.0)
        return {"shaped_bps": device.rates.shaped, "online_peak_bps": int(peak),
                "offline_ceil_bps": classes.get("offline", {}).get("ceil_bps"), "classes": classes}

    # removal ---------------------------------------------------------------------------------
    def _remove(self) -> Dict[str, int]:
        nl, removed = self.nl, {"qdiscs": 0, "ingress": 0, "nft_tables": 0, "rules_routes": 0}
        for nic in self.config.nics().values():
            index = nl.index(nic.name)
            if index is None:
                continue
            removed["qdiscs"] += htb.remove(nl, index)
            removed["ingress"] += htb.detach_ingress(nl, index)
        removed["nft_tables"] += classify.remove(self.config.netns)
        removed["rules_routes"] += routing.remove(nl, self.config)
        self.devices.clear()
        return removed

    def revert(self) -> Dict[str, int]:
        """Remove everything Tidal added (found by its tags, so also after a crash)."""
        with self.lock:
            own = self.nl is None
            if own:
                self.nl = Netlink(self.config.netns)
            try:
                return self._remove()
            finally:
                self.nl.close()
                self.nl = None


def nic_roles(online: str, offline: Optional[str], gateway: Optional[str] = None) -> Tuple[NicRole, Optional[NicRole]]:
    return parse_nic(online), (parse_nic(offline, gateway) if offline else None)

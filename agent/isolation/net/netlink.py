"""One netlink session in the shaped network namespace, and the ``nft`` runner.

tc, links, rules and routes go through pyroute2 (rtnetlink), link speed
through ethtool's generic-netlink family; nothing shells out for them.
nftables has no stable netlink binding in Python, so the classifier's rules
go through the ``nft`` program, run with ``nsenter --net`` when a namespace is
named: ``ip netns exec`` would remount /sys for the namespace and hide
``/sys/fs/cgroup``, where nft resolves cgroup2 paths.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Dict, List, Optional

from agent.isolation.net.policy import NetError


def _pyroute2():
    try:
        import pyroute2  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise NetError(f"pyroute2 is not installed ({exc}); pip install pyroute2") from None
    return pyroute2


class Netlink:
    """rtnetlink (and ethtool) in ``netns`` (a name under /run/netns) or the caller's namespace."""

    def __init__(self, netns: Optional[str] = None) -> None:
        pyroute2 = _pyroute2()
        if netns is not None and not os.path.exists(f"/run/netns/{netns}"):
            raise NetError(f"network namespace {netns!r} does not exist (/run/netns/{netns})")
        self.netns = netns
        try:
            self.ipr = pyroute2.IPRoute(netns=netns) if netns else pyroute2.IPRoute()
        except Exception as exc:
            raise NetError(f"cannot open rtnetlink{' in ' + netns if netns else ''}: {exc}") from None

    def close(self) -> None:
        try:
            self.ipr.close()
        except Exception:
            pass

    # links -------------------------------------------------------------------------------
    def index(self, name: str) -> Optional[int]:
        found = self.ipr.link_lookup(ifname=name)
        return found[0] if found else None

    def require(self, name: str) -> int:
        index = self.index(name)
        if index is None:
            where = f" in network namespace {self.netns!r}" if self.netns else ""
            raise NetError(f"NIC {name!r} does not exist{where}")
        return index

    def link(self, index: int) -> Dict[str, Any]:
        msg = self.ipr.get_links(index)[0]
        return {"name": msg.get_attr("IFLA_IFNAME"), "operstate": msg.get_attr("IFLA_OPERSTATE"),
                "carrier": msg.get_attr("IFLA_CARRIER"), "up": bool(msg["flags"] & 1),
                "kind": _link_kind(msg)}

    def is_running(self, index: int) -> bool:
        """Admin up with a carrier: traffic sent through it can arrive."""
        info = self.link(index)
        return info["up"] and info["carrier"] == 1 and info["operstate"] in ("UP", "UNKNOWN")

    def speed_bps(self, name: str) -> Optional[int]:
        """The link's speed from ethtool (netlink), or ``None`` when the driver does not say."""
        try:
            from pyroute2.netlink.generic.ethtool import NlEthtool
            ethtool = NlEthtool(netns=self.netns) if self.netns else NlEthtool()
            try:
                reply = ethtool.get_linkmode(name)
            finally:
                ethtool.close()
            speed = reply[0].get_attr("ETHTOOL_A_LINKMODES_SPEED") if reply else None
        except Exception:
            return None
        if speed is None or speed <= 0 or speed >= 0xFFFFFFFF:
            return None
        return int(speed) * 1_000_000

    def addresses(self, index: int) -> List[str]:
        return [m.get_attr("IFA_ADDRESS") for m in self.ipr.get_addr(index=index, family=2)]

    def default_gateway(self, index: int) -> Optional[str]:
        """The main table's default route through this NIC, if it has one."""
        for route in self.ipr.get_routes(family=2, table=254):
            if route["dst_len"] == 0 and route.get_attr("RTA_OIF") == index:
                return route.get_attr("RTA_GATEWAY")
        return None


def _link_kind(msg) -> Optional[str]:
    info = msg.get_attr("IFLA_LINKINFO")
    return info.get_attr("IFLA_INFO_KIND") if info is not None else None


def nft_available() -> Optional[str]:
    return shutil.which("nft")


def run_nft(netns: Optional[str], args: List[str], script: Optional[str] = None) -> str:
    """Run ``nft`` (in ``netns``); its stderr becomes the error line."""
    nft = nft_available()
    if nft is None:
        raise NetError("nft (the nftables package) is not installed; it classifies traffic by cgroup")
    argv = ([shutil.which("nsenter") or "nsenter", f"--net=/run/netns/{netns}"] if netns else []) + [nft] + args
    done = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        message = " ".join(done.stderr.strip().splitlines()[:2]) or f"exit status {done.returncode}"
        raise NetError(f"nft {' '.join(args)}: {message}")
    return done.stdout

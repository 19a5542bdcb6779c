"""Which traffic is offline: sockets made by tasks of the reclaimed tree.

Classifiers, in the order Tidal tries them (``detect``):

* ``nft-cgroupv2``: an nftables table ``inet tidal`` whose output chain matches
  ``socket cgroupv2 level N "<path>"`` (the cgroup2 cgroup a socket was made
  in: the reclaimed tree itself on cgroup v2, its membership mirror on hybrid
  v1 hosts, see ``KernelCgroups``). A match gets Tidal's mark bits (policy
  routing) and ``meta priority 1a1d:20`` (HTB takes it into the offline class
  without any tc filter), and the mark is copied to the connection. The chain
  is ``type route`` so that the kernel routes a packet again after its mark
  changed. A second chain NATs offline connections' source ports into
  61440-65535 (``OFFLINE_PORT_MASK``) and, through the offline NIC, their
  source address to that NIC's: replies then find their way back, and their
  ports mark them on ingress.
* ``none``: no nft, or no cgroup2 hierarchy under ``/sys/fs/cgroup`` (nft
  resolves paths there). The classes are still built and online is still
  first, but nothing is counted as offline; ``tidal net status`` says so.

v1's ``net_cls`` class ids are not used: the controller is rarely mounted on
hybrid hosts, and on this one the kernel has no ``cls_cgroup`` to read them.

The whole table is Tidal's: it is replaced in one nft transaction (so a restart
adopts rather than duplicates it) and removed with ``delete table``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from agent.isolation.net.netlink import nft_available, run_nft
from agent.isolation.net.policy import CLASS_OFFLINE, CLASS_SYSTEM, HTB_MAJOR, OFFLINE_PORT_MASK, NetConfig

TABLE = "tidal"
NFT_CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CgroupMatch:
    """A cgroup2 directory as nft names it: a path under /sys/fs/cgroup and its depth in the hierarchy."""

    path: str
    level: int

    @classmethod
    def of(cls, directory: str, cgroup2_root: str) -> Optional["CgroupMatch"]:
        directory, root = os.path.normpath(directory), os.path.normpath(cgroup2_root)
        if os.path.commonpath([directory, NFT_CGROUP_ROOT]) != NFT_CGROUP_ROOT:
            return None
        depth = os.path.relpath(directory, root)
        if depth.startswith(".."):
            return None
        return cls(os.path.relpath(directory, NFT_CGROUP_ROOT), 0 if depth == "." else len(depth.split("/")))


@dataclass(frozen=True)
class Classifier:
    kind: str  # "nft-cgroupv2" or "none"
    offline: Optional[CgroupMatch] = None
    system: Optional[CgroupMatch] = None
    reason: str = ""

    def describe(self) -> str:
        if self.kind == "none":
            return f"none ({self.reason})"
        return f"nft socket cgroupv2 level {self.offline.level} \"{self.offline.path}\""


def detect(offline_dir: Optional[str], system_dir: Optional[str], cgroup2_root: Optional[str]) -> Classifier:
    if nft_available() is None:
        return Classifier("none", reason="nft is not installed")
    if offline_dir is None or cgroup2_root is None:
        return Classifier("none", reason="the host has no cgroup2 hierarchy to match sockets by")
    offline = CgroupMatch.of(offline_dir, cgroup2_root)
    if offline is None:
        return Classifier("none", reason=f"cgroup2 is mounted at {cgroup2_root}, not under {NFT_CGROUP_ROOT}, "
                                         f"where nft resolves cgroup paths")
    system = CgroupMatch.of(system_dir, cgroup2_root) if system_dir else None
    return Classifier("nft-cgroupv2", offline, system)


def _classid(handle: int) -> str:
    return f"{HTB_MAJOR:x}:{handle & 0xFFFF:x}"


def ruleset(config: NetConfig, classifier: Classifier, offline_nic: Optional[str], nics: List[str]) -> str:
    """The nft script that (re)creates Tidal's table atomically."""
    mark = f"meta mark set meta mark & {~config.mask & 0xFFFFFFFF:#010x} | {config.mark:#010x}"
    lines = [f"table inet {TABLE} {{}}", f"delete table inet {TABLE}", f"table inet {TABLE} {{",
             '  comment "owned by tidal: removed by tidal agent --revert or a clean shutdown"']
    lines += ["  chain classify {", "    type route hook output priority mangle; policy accept;"]
    if classifier.system is not None:
        lines.append(f'    socket cgroupv2 level {classifier.system.level} "{classifier.system.path}" '
                     f"meta priority set {_classid(CLASS_SYSTEM)}")
    if classifier.offline is not None:
        lines.append(f'    socket cgroupv2 level {classifier.offline.level} "{classifier.offline.path}" '
                     f"{mark} meta priority set {_classid(CLASS_OFFLINE)} ct mark set meta mark")
    lines.append("  }")
    if classifier.offline is not None:
        low = OFFLINE_PORT_MASK
        offline = f"meta mark & {config.mask:#010x} == {config.mark:#010x} meta l4proto {{ tcp, udp }}"
        lines += ["  chain ports {", "    type nat hook postrouting priority srcnat; policy accept;"]
        for nic in nics:
            lines.append(f'    oifname "{nic}" {offline} masquerade to :{low}-65535')
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def apply(config: NetConfig, classifier: Classifier, offline_nic: Optional[str], nics: List[str]) -> None:
    if classifier.kind == "none":
        return
    run_nft(config.netns, ["-f", "-"], ruleset(config, classifier, offline_nic, nics))


def present(netns: Optional[str]) -> bool:
    if nft_available() is None:
        return False
    try:
        run_nft(netns, ["list", "table", "inet", TABLE])
        return True
    except Exception:
        return False


def remove(netns: Optional[str]) -> bool:
    if not present(netns):
        return False
    run_nft(netns, ["delete", "table", "inet", TABLE])
    return True

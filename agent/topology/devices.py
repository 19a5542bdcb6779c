"""GPUs and NICs with their NUMA locality, from sysfs (and NVML when present).

* PCI devices: ``/sys/bus/pci/devices/<bdf>`` (links into ``/sys/devices``),
  attributes ``class``, ``vendor``, ``numa_node``, ``local_cpulist`` /
  ``local_cpus`` (Documentation/ABI/testing/sysfs-bus-pci).
* GPUs: display/3D controllers (class 0x03xxxx) of NVIDIA (0x10de) and AMD
  (0x1002), plus every bus id the NVIDIA driver lists under
  ``/proc/driver/nvidia/gpus`` (some compute boards report class 0x0302 or
  sit behind switches the class scan misses).
* NICs: every entry of ``/sys/class/net``; physical when it has a ``device``
  link outside ``/sys/devices/virtual``; its PCI address is the nearest PCI
  function above it (a virtio NIC sits under ``virtioN`` below its PCI
  function).
* Locality: ``numa_node`` when it is >= 0; else the NUMA node holding most
  of ``local_cpulist``; a single-node machine puts everything on node 0.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from agent.topology.hostfs import HostFS
from agent.topology.model import Gpu, Nic, NumaNode
from agent.topology.parse import parse_cpulist, parse_cpumask, parse_int

PCI_BUS = "/sys/bus/pci/devices"
NET_CLASS = "/sys/class/net"
NVIDIA_PROC = "/proc/driver/nvidia/gpus"
_BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
GPU_VENDORS = {0x10DE: "nvidia", 0x1002: "amd"}


def normalize_bdf(bdf: str) -> str:
    """``"00000000:3B:00.0"`` (NVML) -> ``"0000:3b:00.0"`` (sysfs)."""
    domain, rest = bdf.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def _attr_int(fs: HostFS, path: str) -> Optional[int]:
    text = fs.read_attr(path)
    if text is None:
        return None
    try:
        return parse_int(text)
    except ValueError:
        return None


def device_numa(fs: HostFS, device_dir: str, numa_nodes: Sequence[NumaNode]) -> Optional[int]:
    """NUMA node of a device directory (kernel path), see module docstring."""
    node = _attr_int(fs, f"{device_dir}/numa_node")
    known = {n.id for n in numa_nodes}
    if node is not None and node >= 0 and node in known:
        return node
    local = None
    text = fs.read_attr(f"{device_dir}/local_cpulist")
    try:
        if text is not None:
            local = set(parse_cpulist(text))
        else:
            text = fs.read_attr(f"{device_dir}/local_cpus")
            if text is not None:
                local = set(parse_cpumask(text))
    except ValueError:
        local = None
    with_cpus = [n for n in numa_nodes if n.cpus]
    if local and with_cpus:
        best = max(with_cpus, key=lambda n: (len(local.intersection(n.cpus)), -n.id))
        covered_all = all(local.issuperset(n.cpus) for n in with_cpus)
        if best.cpus and local.intersection(best.cpus) and not (covered_all and len(with_cpus) > 1):
            return best.id
    if len(numa_nodes) == 1:
        return numa_nodes[0].id
    return None


def _pci_devices(fs: HostFS) -> Dict[str, str]:
    """``{bdf: kernel path of its directory}``."""
    devices = {}
    for name in fs.listdir(PCI_BUS):
        if _BDF.match(name):
            devices[name.lower()] = fs.realpath(f"{PCI_BUS}/{name}")
    return devices


def discover_gpus(fs: HostFS, numa_nodes: Sequence[NumaNode], warnings: List[str]) -> List[Gpu]:
    pci = _pci_devices(fs)
    found: Dict[str, str] = {}
    for bdf, directory in pci.items():
        cls = _attr_int(fs, f"{directory}/class")
        vendor = _attr_int(fs, f"{directory}/vendor")
        if cls is not None and (cls >> 16) == 0x03 and vendor in GPU_VENDORS:
            found[bdf] = GPU_VENDORS[vendor]
    for name in fs.listdir(NVIDIA_PROC):
        try:
            found.setdefault(normalize_bdf(name), "nvidia")
        except ValueError:
            continue
    gpus = []
    for bdf in sorted(found):
        directory = pci.get(bdf, f"{PCI_BUS}/{bdf}")
        gpus.append(Gpu(pci=bdf, vendor=found[bdf], numa=device_numa(fs, directory, numa_nodes)))
    if fs.is_live and any(g.vendor == "nvidia" for g in gpus):
        from agent.topology.nvml import enrich_with_nvml

        gpus = enrich_with_nvml(gpus, warnings)
    return gpus


def _nearest_pci(path: str) -> Optional[str]:
    for part in reversed(path.split("/")):
        if _BDF.match(part):
            return part.lower()
    return None


def discover_nics(fs: HostFS, numa_nodes: Sequence[NumaNode]) -> List[Nic]:
    nics = []
    for name in fs.listdir(NET_CLASS):
        real = fs.realpath(f"{NET_CLASS}/{name}")
        has_device = fs.exists(f"{real}/device")
        physical = has_device and "/devices/virtual/" not in real
        pci = numa = None
        if physical:
            device = fs.realpath(f"{real}/device")
            pci = _nearest_pci(device)
            if pci is not None:
                # the PCI function's own directory carries numa_node/local_cpulist
                pci_dir = device[: device.find(pci) + len(pci)] if pci in device else device
                numa = device_numa(fs, pci_dir, numa_nodes)
            else:
                numa = device_numa(fs, device, numa_nodes)
        speed = _attr_int(fs, f"{real}/speed")
        mac = (fs.read_attr(f"{real}/address") or "").strip() or None
        nics.append(Nic(name=name, pci=pci, numa=numa, speed_mbps=speed if speed and speed > 0 else None,
                        mac=mac, physical=physical))
    return nics

"""Build fake sysfs/procfs trees of synthetic shapes.

For the unit tests of every layer above discovery (and for demos and
benchmarks): ``write_tree(root, Shape(sockets=2, numa_per_socket=2,
cores_per_numa=8, threads_per_core=2, gpus=(0, 1, 2, 3), nics=(...)))``
writes a tree that ``discover(HostFS(root))`` reads like a real machine.

Numbering follows Linux on x86: the first thread of every core is numbered
first (cpu = thread * total_cores + core), so siblings are ``{c, c + n}``.
The odd-tree switches (``masks_only``, ``no_node_dir``, ``no_topology``,
``offline``, ``memory_only_nodes``) reproduce what old kernels and odd
machines look like.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

from agent.topology.parse import format_cpulist

GiB = 1024 ** 3


@dataclass(frozen=True)
class FakeNic:
    name: str
    numa: int
    speed_mbps: int = 25000


@dataclass(frozen=True)
class Shape:
    sockets: int = 2
    numa_per_socket: int = 2
    cores_per_numa: int = 8
    threads_per_core: int = 2
    l3_per_numa: int = 1
    memory_per_numa: int = 16 * GiB
    gpus: Tuple[int, ...] = ()  # NUMA node of each GPU
    nics: Tuple[FakeNic, ...] = ()
    offline: Tuple[int, ...] = ()  # cpu ids that are present but offline
    memory_only_nodes: int = 0  # extra NUMA nodes with memory and no cpus
    masks_only: bool = False  # old kernels: hex masks, no *_list files
    no_node_dir: bool = False  # kernel without NUMA support in sysfs
    no_topology: Tuple[int, ...] = ()  # cpus whose topology/ dir is missing
    model: str = "Synthetic CPU @ 2.00GHz"

    @property
    def cores(self) -> int:
        return self.sockets * self.numa_per_socket * self.cores_per_numa

    @property
    def cpus(self) -> int:
        return self.cores * self.threads_per_core

    def numa_count(self) -> int:
        return self.sockets * self.numa_per_socket


def format_cpumask(cpus: Iterable[int], nbits: int) -> str:
    """``{8..15}, 64 -> "00000000,0000ff00"`` (32-bit words, most significant first)."""
    value = 0
    for cpu in cpus:
        value |= 1 << cpu
    words = max(1, (nbits + 31) // 32)
    text = f"{value:0{words * 8}x}"
    return ",".join(text[i:i + 8] for i in range(0, len(text), 8))


def layout(shape: Shape) -> List[Dict[str, object]]:
    """One dict per cpu: id, core, socket, numa, l3, siblings (the truth the tree encodes)."""
    cpus = []
    core_index = 0
    per_numa = shape.cores_per_numa
    l3_size = max(1, per_numa // max(1, shape.l3_per_numa))
    for socket in range(shape.sockets):
        for local_numa in range(shape.numa_per_socket):
            numa = socket * shape.numa_per_socket + local_numa
            for local_core in range(per_numa):
                l3 = numa * shape.l3_per_numa + min(local_core // l3_size, shape.l3_per_numa - 1)
                siblings = [t * shape.cores + core_index for t in range(shape.threads_per_core)]
                for cpu in siblings:
                    cpus.append({"id": cpu, "core": core_index, "core_id": socket * 1000 + local_numa * 100 + local_core,
                                 "socket": socket, "numa": numa, "l3": l3, "siblings": siblings})
                core_index += 1
    return sorted(cpus, key=lambda c: c["id"])


def _makedirs(directory: str) -> None:
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)


def _write(root: str, path: str, text: str) -> None:
    full = os.path.join(root, path.lstrip("/"))
    _makedirs(os.path.dirname(full))
    with open(full, "w") as handle:
        handle.write(text if text.endswith("\n") else text + "\n")


def _link(root: str, link: str, target: str) -> None:
    full = os.path.join(root, link.lstrip("/"))
    _makedirs(os.path.dirname(full))
    os.symlink(target, full)


def _cpuset_files(root: str, directory: str, list_name: str, mask_name: str, cpus: Sequence[int],
                  nbits: int, masks_only: bool) -> None:
    if not masks_only:
        _write(root, f"{directory}/{list_name}", format_cpulist(cpus))
    _write(root, f"{directory}/{mask_name}", format_cpumask(cpus, nbits))


def write_tree(root: str, shape: Shape = Shape()) -> str:
    """Write the tree for ``shape`` under ``root``; returns ``root``."""
    cpus = layout(shape)
    nbits = shape.cpus
    online = [c["id"] for c in cpus if c["id"] not in shape.offline]
    cpu_dir = "/sys/devices/system/cpu"
    _write(root, f"{cpu_dir}/present", format_cpulist(c["id"] for c in cpus))
    _write(root, f"{cpu_dir}/possible", format_cpulist(c["id"] for c in cpus))
    _write(root, f"{cpu_dir}/online", format_cpulist(online))
    _write(root, f"{cpu_dir}/offline", format_cpulist(shape.offline))
    online_set = set(online)
    by_socket: Dict[int, List[int]] = {}
    by_l3: Dict[int, List[int]] = {}
    by_numa: Dict[int, List[int]] = {}
    for c in cpus:
        if c["id"] in online_set:
            by_socket.setdefault(c["socket"], []).append(c["id"])
            by_l3.setdefault(c["l3"], []).append(c["id"])
            by_numa.setdefault(c["numa"], []).append(c["id"])
    for c in cpus:
        base = f"{cpu_dir}/cpu{c['id']}"
        if c["id"] != 0:
            _write(root, f"{base}/online", "0" if c["id"] in shape.offline else "1")
        if c["id"] in shape.offline:
            continue
        if c["id"] not in shape.no_topology:
            topo = f"{base}/topology"
            siblings = [s for s in c["siblings"] if s in online_set]
            _cpuset_files(root, topo, "thread_siblings_list", "thread_siblings", siblings, nbits, shape.masks_only)
            _cpuset_files(root, topo, "core_siblings_list", "core_siblings", by_socket[c["socket"]], nbits,
                          shape.masks_only)
            _write(root, f"{topo}/physical_package_id", str(c["socket"]))
            _write(root, f"{topo}/core_id", str(c["core_id"]))
            if not shape.masks_only:
                _write(root, f"{topo}/die_id", "0")
                _write(root, f"{topo}/die_cpus_list", format_cpulist(by_socket[c["socket"]]))
        cache = f"{base}/cache"
        _write(root, f"{cache}/index0/level", "1")
        _write(root, f"{cache}/index0/type", "Data")
        _cpuset_files(root, f"{cache}/index0", "shared_cpu_list", "shared_cpu_map",
                      [s for s in c["siblings"] if s in online_set], nbits, shape.masks_only)
        _write(root, f"{cache}/index3/level", "3")
        _write(root, f"{cache}/index3/type", "Unified")
        _cpuset_files(root, f"{cache}/index3", "shared_cpu_list", "shared_cpu_map", by_l3[c["l3"]], nbits,
                      shape.masks_only)
    numa_total = shape.numa_count() + shape.memory_only_nodes
    if not shape.no_node_dir:
        node_dir = "/sys/devices/system/node"
        ids = list(range(numa_total))
        _write(root, f"{node_dir}/online", format_cpulist(ids))
        _write(root, f"{node_dir}/possible", format_cpulist(ids))
        for nid in ids:
            members = by_numa.get(nid, [])
            base = f"{node_dir}/node{nid}"
            _cpuset_files(root, base, "cpulist", "cpumap", members, nbits, shape.masks_only)
            kib = shape.memory_per_numa // 1024
            _write(root, f"{base}/meminfo", f"Node {nid} MemTotal:       {kib} kB\nNode {nid} MemFree:        {kib // 2} kB\n")
            row = []
            for other in ids:
                if other == nid:
                    row.append(10)
                elif other < shape.numa_count() and nid < shape.numa_count() and \
                        other // shape.numa_per_socket == nid // shape.numa_per_socket:
                    row.append(12)
                else:
                    row.append(32)
            _write(root, f"{base}/distance", " ".join(map(str, row)))
    total_kib = shape.memory_per_numa * numa_total // 1024
    _write(root, "/proc/meminfo", f"MemTotal:       {total_kib} kB\nMemFree:        {total_kib // 2} kB\n")
    blocks = []
    for c in cpus:
        if c["id"] in shape.offline:
            continue
        blocks.append(
            f"processor\t: {c['id']}\nvendor_id\t: GenuineSynthetic\nmodel name\t: {shape.model}\n"
            f"physical id\t: {c['socket']}\ncore id\t\t: {c['core_id']}\nflags\t\t: fpu sse sse2 avx2\n")
    _write(root, "/proc/cpuinfo", "\n".join(blocks))
    # PCI devices: GPUs then NICs, one root port each.
    for i, numa in enumerate(shape.gpus):
        bdf = f"0000:{0x10 + i:02x}:00.0"
        device = f"/sys/devices/pci0000:{0x10 + i:02x}/{bdf}"
        _write(root, f"{device}/class", "0x030200")
        _write(root, f"{device}/vendor", "0x10de")
        _write(root, f"{device}/numa_node", str(numa))
        _write(root, f"{device}/local_cpulist", format_cpulist(by_numa.get(numa, [])))
        _link(root, f"/sys/bus/pci/devices/{bdf}", f"../../../devices/pci0000:{0x10 + i:02x}/{bdf}")
    for i, nic in enumerate(shape.nics):
        bus = 0x80 + i
        bdf = f"0000:{bus:02x}:00.0"
        device = f"/sys/devices/pci0000:{bus:02x}/{bdf}"
        _write(root, f"{device}/class", "0x020000")
        _write(root, f"{device}/vendor", "0x8086")
        _write(root, f"{device}/numa_node", str(nic.numa))
        _write(root, f"{device}/local_cpulist", format_cpulist(by_numa.get(nic.numa, [])))
        _write(root, f"{device}/net/{nic.name}/address", f"02:00:00:00:00:{i:02x}")
        _write(root, f"{device}/net/{nic.name}/speed", str(nic.speed_mbps))
        _link(root, f"{device}/net/{nic.name}/device", "../../../" + bdf)
        _link(root, f"/sys/bus/pci/devices/{bdf}", f"../../../devices/pci0000:{bus:02x}/{bdf}")
        _link(root, f"/sys/class/net/{nic.name}", f"../../devices/pci0000:{bus:02x}/{bdf}/net/{nic.name}")
    _write(root, "/sys/devices/virtual/net/lo/address", "00:00:00:00:00:00")
    _link(root, "/sys/class/net/lo", "../../devices/virtual/net/lo")
    return root


def build_topology(shape: Shape):
    """The ``Topology`` that ``discover`` reads from ``write_tree(root, shape)``,
    built in memory (for property tests that need thousands of shapes)."""
    from agent.topology.model import Cpu, Gpu, Nic, NumaNode, Topology, group_ids

    cpus = layout(shape)
    online = [c for c in cpus if c["id"] not in shape.offline]
    online_ids = {c["id"] for c in online}
    core_of = group_ids({tuple(s for s in c["siblings"] if s in online_ids) for c in online})
    socket_of = group_ids({tuple(x["id"] for x in online if x["socket"] == c["socket"]) for c in online})
    l3_of = group_ids({tuple(x["id"] for x in online if x["l3"] == c["l3"]) for c in online})
    result = []
    for c in cpus:
        if c["id"] not in online_ids:
            result.append(Cpu(id=c["id"], online=False))
            continue
        result.append(Cpu(id=c["id"], online=True, core=core_of[c["id"]], socket=socket_of[c["id"]],
                          die=socket_of[c["id"]], numa=c["numa"], l3=l3_of[c["id"]],
                          siblings=tuple(sorted(s for s in c["siblings"] if s in online_ids))))
    total = shape.numa_count() + shape.memory_only_nodes
    nodes = []
    for nid in range(total):
        row = []
        for other in range(total):
            if other == nid:
                row.append((other, 10))
            elif other < shape.numa_count() and nid < shape.numa_count() and \
                    other // shape.numa_per_socket == nid // shape.numa_per_socket:
                row.append((other, 12))
            else:
                row.append((other, 32))
        nodes.append(NumaNode(id=nid, cpus=tuple(c["id"] for c in online if c["numa"] == nid),
                              memory_bytes=shape.memory_per_numa, distances=tuple(row)))
    gpus = tuple(Gpu(pci=f"0000:{0x10 + i:02x}:00.0", vendor="nvidia", numa=numa) for i, numa in enumerate(shape.gpus))
    nics = tuple(Nic(name=n.name, pci=f"0000:{0x80 + i:02x}:00.0", numa=n.numa, speed_mbps=n.speed_mbps,
                     mac=f"02:00:00:00:00:{i:02x}", physical=True) for i, n in enumerate(shape.nics))
    return Topology(cpus=tuple(result), numa_nodes=tuple(nodes), gpus=gpus, nics=nics, cpu_model=shape.model,
                    cpu_flags=("avx2", "fpu", "sse", "sse2"))

"""Human-readable rendering of a Topology (``tidal topology`` without --json).

Sockets, NUMA nodes and L3 groups do not always nest (a NUMA node can span
sockets on some machines, a socket can hold several NUMA nodes on most), so
the tree is printed as socket -> (NUMA nodes meeting that socket) -> L3
groups inside both -> cores -> threads.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from agent.topology.model import Topology
from agent.topology.parse import format_cpulist

CORES_PER_LINE = 6


def human_bytes(value: Optional[int]) -> str:
    if value is None:
        return "?"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if amount < 1024 or unit == "PiB":
            return f"{amount:.1f} {unit}" if unit != "B" else f"{int(amount)} B"
        amount /= 1024
    return str(value)


def render_topology(topo: Topology) -> str:
    s = topo.to_dict()["summary"]
    lines = [
        f"{s['sockets']} sockets, {s['dies']} dies, {s['numa_nodes']} NUMA nodes, {s['l3_groups']} L3 groups, "
        f"{s['cores']} cores, {s['online_cpus']} cpus online ({s['threads_per_core']} threads/core)"
        + (f", offline {s['offline_cpus']}" if s["offline_cpus"] else ""),
        f"model: {topo.cpu_model or 'unknown'}",
        "",
    ]
    # group cores by (socket, numa, l3) in cpu order
    layout: Dict[int, Dict[Optional[int], Dict[Optional[int], List[int]]]] = {}
    for core in topo.core_ids():
        first = topo.cpu(topo.cpus_in_core(core)[0])
        layout.setdefault(first.socket, {}).setdefault(first.numa, {}).setdefault(first.l3, []).append(core)
    for socket in sorted(layout):
        lines.append(f"socket {socket}  cpus {format_cpulist(topo.cpus_in_socket(socket))}")
        for numa in sorted(layout[socket], key=lambda n: (n is None, n)):
            if numa is None:
                lines.append("  numa ?  (cpus in no NUMA node)")
            else:
                node = topo.numa_node(numa)
                dist = " ".join(f"{k}:{v}" for k, v in node.distances)
                lines.append(f"  numa {numa}  {human_bytes(node.memory_bytes)}  distances {dist or '?'}")
            for l3 in sorted(layout[socket][numa], key=lambda n: (n is None, n)):
                cores = layout[socket][numa][l3]
                cpus = [c for core in cores for c in topo.cpus_in_core(core)]
                label = f"l3 {l3}" if l3 is not None else "l3 -"
                lines.append(f"    {label}  cpus {format_cpulist(cpus)}")
                cells = [f"core {core}: {','.join(map(str, topo.cpus_in_core(core)))}" for core in cores]
                for i in range(0, len(cells), CORES_PER_LINE):
                    lines.append("      " + "   ".join(cells[i:i + CORES_PER_LINE]))
    memory_only = [n for n in topo.numa_nodes if n.memory_only]
    if memory_only:
        lines.append("")
        lines.append("memory-only NUMA nodes")
        for node in memory_only:
            state = "" if node.online else "  (offline)"
            lines.append(f"  numa {node.id}  {human_bytes(node.memory_bytes)}{state}")
    lines.append("")
    lines.append("GPUs" if topo.gpus else "GPUs: none")
    if topo.gpus:
        lines.extend(_table(["PCI", "VENDOR", "NUMA", "MODEL", "MEMORY", "UUID"], [
            (g.pci, g.vendor, _n(g.numa), g.model or "-", human_bytes(g.memory_bytes) if g.memory_bytes else "-",
             g.uuid or "-") for g in topo.gpus]))
    lines.append("NICs" if topo.nics else "NICs: none")
    if topo.nics:
        lines.extend(_table(["NAME", "PCI", "NUMA", "SPEED", "MAC", "KIND"], [
            (n.name, n.pci or "-", _n(n.numa), f"{n.speed_mbps} Mb/s" if n.speed_mbps else "-", n.mac or "-",
             "physical" if n.physical else "virtual") for n in topo.nics]))
    for warning in topo.warnings:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _n(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def _table(header: List[str], rows: List[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*map(str, r)).rstrip() for r in rows]

"""``tidal plan``: run a list of requests through the policy, in order, as a dry run.

Pure: it takes a topology and a state and returns the final state with a
report; nothing is written anywhere.
"""

from __future__ import annotations

import string
from typing import Dict, List, Sequence, Tuple

from agent.qrm.model import Pools, QoS, Rejection, Request
from agent.qrm.assignment import assignment
from agent.qrm.eviction import choose_victims
from agent.qrm.policy import State, allocate, pools, reclaimed_capacity
from agent.topology import Topology
from agent.topology.parse import format_cpulist


def run_plan(topo: Topology, state: State, requests: Sequence[Request]) -> Tuple[State, List[Rejection]]:
    """Each request in turn; reclaimed work that a later request leaves over the reclaimed capacity (or
    with no cpu at all) is evicted, as the agent does (at once, or after its grace): it comes back among
    the rejections, with why."""
    rejected: List[Rejection] = []
    for request in requests:
        decision = allocate(topo, state, request)
        if isinstance(decision, Rejection):
            rejected.append(decision)
            continue
        state = state.with_allocation(decision)
        capacity = reclaimed_capacity(topo, state)
        for victim in choose_victims(state.allocations, capacity):
            state = state.without(victim.name)
            rejected.append(Rejection(victim.name, f"evicted: after {request.name}, the reclaimed capacity is "
                                                   f"{capacity} millicpu"))
    return state, rejected


def plan_report(topo: Topology, state: State, rejected: Sequence[Rejection]) -> Dict[str, object]:
    """What each workload would get (``qrm.assignment``; reclaimed work on its own pool, as on a
    kernel without ``cpu.idle``: a plan does not know the node's kernel)."""
    pool = pools(topo, state)
    assignments = []
    for alloc in state.allocations:
        given = assignment(topo, alloc, pool, harvest=False)
        entry = {"name": alloc.name, "qos": alloc.qos.value, "cpus": list(given.cpus),
                 "mems": list(given.mems), "millicpu": alloc.millicpu}
        if alloc.gpus:
            entry["gpus"] = list(alloc.gpus)
        if alloc.qos is QoS.RECLAIMED:
            entry["tier"] = alloc.tier.value
        if alloc.nodes:
            entry["numa_held"] = list(alloc.nodes)
        assignments.append(entry)
    return {"assignments": assignments, "pools": pool.to_dict(),
            "rejected": [{"name": r.name, "reason": r.reason} for r in rejected]}


def _symbols(state: State) -> Dict[str, str]:
    letters = string.ascii_lowercase + string.digits
    dedicated = [a.name for a in state.allocations if a.qos is QoS.DEDICATED]
    return {name: letters[i % len(letters)] for i, name in enumerate(dedicated)}


def render_core_map(topo: Topology, state: State, pool: Pools) -> List[str]:
    """One line per NUMA node, one character per cpu, cores separated by spaces.

    ``R`` reserved, ``S`` shared, ``C`` reclaimed, ``.`` held idle, letters:
    dedicated workloads (upper case where reclaimed work may also run).
    """
    symbol = _symbols(state)
    owner: Dict[int, str] = {}
    for alloc in state.allocations:
        if alloc.qos is QoS.DEDICATED:
            for cpu in alloc.cpus:
                owner[cpu] = symbol[alloc.name].upper() if alloc.reclaim_allowed else symbol[alloc.name]
    for cpu in pool.reserved:
        owner[cpu] = "R"
    for cpu in pool.shared:
        owner[cpu] = "S"
    for cpu in pool.reclaimed:
        owner.setdefault(cpu, "C")
    for cpu in pool.idle:
        owner[cpu] = "."
    for cpu in pool.held_back:
        if owner.get(cpu) == "S":
            owner[cpu] = "s"
    lines = []
    for numa in topo.numa_ids():
        cores = topo.cores_in_numa(numa)
        if not cores:
            continue
        cells = ["".join(owner.get(c, "?") for c in topo.cpus_in_core(core)) for core in cores]
        lines.append(f"numa {numa:>3}: " + " ".join(cells))
    legend = ", ".join(f"{v}={k}" for k, v in symbol.items())
    lines.append("R reserved, S shared, C reclaimed, . held idle" + (", s shared, never reclaimed's (SMT sibling "
                 "of a dedicated cpu)" if pool.held_back else "") + (f"; dedicated: {legend}" if legend else ""))
    return lines


def render_plan(topo: Topology, state: State, rejected: Sequence[Rejection]) -> str:
    report = plan_report(topo, state, rejected)
    pool = pools(topo, state)
    rows = [("NAME", "QOS", "CPUS", "MEMS", "MILLICPU")]
    for a in report["assignments"]:
        rows.append((a["name"], a["qos"], format_cpulist(a["cpus"]) or "-", format_cpulist(a["mems"]) or "-",
                     str(a["millicpu"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    for name in ("reserved", "shared", "reclaimed", "dedicated", "held_back"):
        cpus = report["pools"][name]
        if name == "held_back" and not cpus:
            continue
        lines.append(f"{name.replace('_', ' '):<10} {len(cpus):>4} cpus  {format_cpulist(cpus) or '-'}"
                     + ("  (SMT siblings of dedicated cpus: no reclaimed work)" if name == "held_back" else ""))
    lines.append("")
    lines.extend(render_core_map(topo, state, pool))
    if rejected:
        lines.append("")
        lines.append("rejected:")
        lines.extend(f"  {r.name}: {r.reason}" for r in rejected)
    return "\n".join(lines)

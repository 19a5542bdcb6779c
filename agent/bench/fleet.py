"""Node shapes for simulated fleets: what a real machine's agent would publish, from its captured tree.

For each captured sysfs tree (hwloc's test trees, ``tidal topology --capture``)
the shape is the Node's allocatable (the cpus less the reserved pool, the
memory, 110 pods, the reclaimed capacity an idle node lends) and the
NodeResourceTopology its agent writes on start, made by the agent's own report
code (``agent.reporter.nrt.build_nrt`` over ``qrm``'s initial state): the
same bytes an agent on that machine would publish. KWOK nodes of the scheduler
tier and ``tidal bench scheduler`` are made of these.
"""

from __future__ import annotations

from typing import Dict, List

from agent.qrm.policy import initial_state, pools, reclaimed_capacity
from agent.reporter.nrt import build_nrt
from agent.topology import HostFS, discover


def node_shape(name: str, root: str) -> Dict:
    """``{"name", "allocatable", "nrt"}`` for the machine captured under ``root``."""
    topo = discover(HostFS(root), devices=True)
    state = initial_state(topo)
    pool = pools(topo, state)
    cpus = len(topo.online_cpus()) - len(pool.reserved)
    memory = sum(int(n.memory_bytes or 0) for n in topo.numa_nodes)
    reclaimed = reclaimed_capacity(topo, state)
    allocatable = {"cpu": str(max(1, cpus)), "memory": str(memory), "pods": "110",
                   "tidal.io/reclaimed-millicpu": str(reclaimed),
                   "tidal.io/reclaimed-memory": str(memory // 2)}
    gpus = len(topo.gpus)
    if gpus:
        allocatable["nvidia.com/gpu"] = str(gpus)
    nrt = build_nrt("", topo, state, pool, {}, reclaimed, memory // 2, "Online", [], now=0.0)
    return {"name": name, "allocatable": allocatable, "nrt": nrt}


def shapes(roots: Dict[str, str]) -> List[Dict]:
    """One shape per tree (``{name: root}``), machines with no cpu left after the reserved pool dropped."""
    out = []
    for name, root in sorted(roots.items()):
        shape = node_shape(name, root)
        if int(shape["allocatable"]["cpu"]) >= 1 and int(shape["allocatable"]["memory"]) > 0:
            out.append(shape)
    return out

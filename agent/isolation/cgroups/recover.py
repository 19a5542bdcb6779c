"""Rebuild a QRM state from what the kernel shows (the checkpoint was unusable).

The cgroup tree encodes each allocation: a dedicated workload's cpus and mems
are its cpuset; a shared workload's millicpu is its ``cpu.shares`` (the
kubelet's 1024 per cpu), and so is a reclaimed workload's. What
the tree cannot say (``numa_exclusive``, ``reclaim_allowed``, GPUs) is lost,
and the recovery warning says so.
"""

from __future__ import annotations

from typing import List, Optional

from agent.qrm.assignment import SHARES_PER_CPU, memory_nodes
from agent.isolation.cgroups.driver import CgroupDriver
from agent.isolation.cgroups.knobs import weight_to_shares
from agent.qrm.model import Allocation, QoS, Tier
from agent.qrm.policy import State, initial_state
from agent.topology import Topology
from agent.topology.parse import parse_cpulist


def _cpus(driver: CgroupDriver, path: str, file: str) -> tuple:
    controller = "" if driver.version == 2 else "cpuset"
    try:
        return parse_cpulist(driver.read(controller, path, file) or "")
    except ValueError:
        return ()


def _shares(driver: CgroupDriver, path: str) -> Optional[int]:
    if driver.version == 1:
        text = driver.read("cpu", path, "cpu.shares")
        return int(text) if text and text.strip().isdigit() else None
    text = driver.read("", path, "cpu.weight")
    return weight_to_shares(int(text)) if text and text.strip().isdigit() else None


def recover_state(driver: CgroupDriver, base: str, topo: Topology,
                  reserved: Optional[tuple] = None) -> Optional[State]:
    """The state the tree under ``base`` shows; ``None`` if there is no tree. ``reserved``: the
    reserved cpus when the caller knows them (its configuration); else read from the system
    cgroup, whose cpuset is the reserved pool (or the shared pool when there is none)."""
    if not driver.exists(base):
        return None
    online = set(topo.online_cpus())
    if reserved is None:
        reserved = tuple(c for c in _cpus(driver, f"{base}/system", "cpuset.cpus") if c in online) or None
    try:
        state = initial_state(topo, reserved)
    except Exception:  # noqa: BLE001 - a tree from another machine shape: fall back to defaults
        state = initial_state(topo)
    all_mems = memory_nodes(topo)
    allocations: List[Allocation] = []
    for name in driver.children(f"{base}/dedicated"):
        path = f"{base}/dedicated/{name}"
        cpus = _cpus(driver, path, "cpuset.cpus")
        mems = _cpus(driver, path, "cpuset.mems") or all_mems
        if cpus:
            allocations.append(Allocation(name=name, qos=QoS.DEDICATED, millicpu=len(cpus) * 1000, cpus=cpus,
                                          mems=mems, numa_binding=set(mems) != set(all_mems)))
    for name in driver.children(f"{base}/shared"):
        shares = _shares(driver, f"{base}/shared/{name}") or SHARES_PER_CPU
        allocations.append(Allocation(name=name, qos=QoS.SHARED, millicpu=max(1, round(shares * 1000 / SHARES_PER_CPU)),
                                      mems=all_mems))
    for tier in Tier:
        for name in driver.children(f"{base}/reclaimed/{tier.value}"):
            shares = _shares(driver, f"{base}/reclaimed/{tier.value}/{name}") or SHARES_PER_CPU
            millicpu = max(1, round(shares * 1000 / SHARES_PER_CPU))
            allocations.append(Allocation(name=name, qos=QoS.RECLAIMED, millicpu=millicpu, tier=tier, mems=all_mems))
    taken = set(state.reserved)
    for alloc in allocations:
        if alloc.qos is QoS.DEDICATED and (not set(alloc.cpus) <= online or set(alloc.cpus) & taken):
            continue  # off this node, or a cpu someone else already holds: never two owners of one cpu
        if state.get(alloc.name) is None:
            state = state.with_allocation(alloc)
            taken |= set(alloc.cpus)
    return state

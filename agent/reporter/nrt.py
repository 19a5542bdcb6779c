"""The node's topology report: a NodeResourceTopology (``topology.node.k8s.io/v1alpha2``).

The format the upstream scheduler-plugins NodeResourceTopologyMatch plugin
reads, and Tidal's extender too. One zone per NUMA node with cpus, named
``node-N``, type ``Node``:

* ``cpu``: capacity = the zone's online cpus; allocatable = less the reserved
  (system) cpus; available = less cpus held by dedicated workloads and the
  zone's share of shared workloads' requests (millicores).
* ``memory``: capacity = allocatable = the zone's memory; available = less
  the memory requested by pods bound to the zone (split over their NUMA nodes).
* ``nvidia.com/gpu`` where the zone has GPUs: less those allocated.
* costs: the NUMA distances to every zone.

Top-level attributes: ``tidal.io/policy``, ``nodeTopologyPodsFingerprint``
(a hash of the admitted pods, as upstream names it), ``tidal.io/pods`` (their
UIDs: the extender drops its reservation for a pod once the report has it),
``tidal.io/updated``
(when the agent made the report: stale reports are not trusted),
``tidal.io/node-state`` (lending) and the reclaimed capacity. ``to_report``
reads one back into the placement core's ``NodeReport``.
"""

from __future__ import annotations

import calendar
import hashlib
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional

from agent.k8s import timeouts
from agent.qrm.assignment import assignment
from agent.qrm.model import QoS

GROUP, VERSION, PLURAL = "topology.node.k8s.io", "v1alpha2", "noderesourcetopologies"
GPU_RESOURCE = "nvidia.com/gpu"


def _rfc3339(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def pods_fingerprint(uids: Iterable[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(uids)).encode()).hexdigest()[:16]
    return f"pfp0v001{digest}"


def build_nrt(node: str, topology, state, pools, pod_memory: Mapping[str, int], reclaimed_millicpu: int,
              reclaimed_memory: int, node_state: str, pod_uids: Iterable[str], now: Optional[float] = None,
              policy: str = "tidal-qrm") -> Dict[str, Any]:
    """``pod_memory``: workload name -> bytes requested (for NUMA-bound workloads' zones)."""
    now = time.time() if now is None else now
    pod_uids = list(pod_uids)
    reserved = set(pools.reserved)
    shared_cpus = set(pools.shared)
    shared_request = sum(a.millicpu for a in state.allocations if a.qos is QoS.SHARED)
    numa_with_cpus = [n for n in topology.numa_nodes if n.cpus]
    total_shared = max(1, len(shared_cpus))
    memory_used: Dict[int, float] = {}
    gpu_used: Dict[int, int] = {}
    dedicated: Dict[int, int] = {}
    for alloc in state.allocations:
        if alloc.qos is QoS.DEDICATED:
            given = assignment(topology, alloc, pools, harvest=False)  # the one rule: its cpus and mems
            for cpu in given.cpus:
                numa = topology.numa_of(cpu)
                dedicated[numa] = dedicated.get(numa, 0) + 1
            if alloc.numa_binding and given.mems:
                for numa in given.mems:
                    memory_used[numa] = memory_used.get(numa, 0.0) + pod_memory.get(alloc.name, 0) / len(given.mems)
        for pci in alloc.gpus:
            gpu = next((g for g in topology.gpus if g.pci == pci), None)
            if gpu is not None and gpu.numa is not None:
                gpu_used[gpu.numa] = gpu_used.get(gpu.numa, 0) + 1
    zones: List[Dict[str, Any]] = []
    for numa in numa_with_cpus:
        cpus = set(numa.cpus) & set(topology.online_cpus())
        allocatable = len(cpus - reserved)
        zone_shared = len(cpus & shared_cpus)
        shared_here = shared_request * zone_shared / total_shared
        available_m = max(0, allocatable * 1000 - dedicated.get(numa.id, 0) * 1000 - int(round(shared_here)))
        memory = int(numa.memory_bytes or 0)
        resources = [
            {"name": "cpu", "capacity": str(len(cpus)), "allocatable": str(allocatable),
             "available": f"{available_m}m"},
            {"name": "memory", "capacity": str(memory), "allocatable": str(memory),
             "available": str(max(0, int(memory - memory_used.get(numa.id, 0))))},
        ]
        gpus = sum(1 for g in topology.gpus if g.numa == numa.id)
        if gpus:
            resources.append({"name": GPU_RESOURCE, "capacity": str(gpus), "allocatable": str(gpus),
                              "available": str(max(0, gpus - gpu_used.get(numa.id, 0)))})
        costs = [{"name": f"node-{other}", "value": int(dist)} for other, dist in numa.distances]
        zone: Dict[str, Any] = {"name": f"node-{numa.id}", "type": "Node", "resources": resources}
        if costs:
            zone["costs"] = costs
        zones.append(zone)
    attributes = [
        {"name": "tidal.io/policy", "value": policy},
        {"name": "nodeTopologyPodsFingerprint", "value": pods_fingerprint(pod_uids)},
        {"name": "tidal.io/pods", "value": ",".join(sorted(pod_uids))},
        {"name": "tidal.io/updated", "value": _rfc3339(now)},
        {"name": "tidal.io/node-state", "value": node_state},
        {"name": "tidal.io/reclaimed-millicpu", "value": str(int(reclaimed_millicpu))},
        {"name": "tidal.io/reclaimed-memory", "value": str(int(reclaimed_memory))},
    ]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeResourceTopology",
            "metadata": {"name": node, "labels": {"app.kubernetes.io/managed-by": "tidal"}},
            "zones": zones, "attributes": attributes}


def check_crd(custom_api, error=RuntimeError) -> None:
    """Raise ``error`` with one line when the NodeResourceTopology CRD is not served."""
    from kubernetes.client.exceptions import ApiException

    try:
        custom_api.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1, _request_timeout=timeouts.CALL)
    except ApiException as exc:
        if exc.status == 404:
            raise error(f"the NodeResourceTopology CRD ({PLURAL}.{GROUP}/{VERSION}) is not installed: "
                        f"kubectl apply -f deploy/crd-noderesourcetopology.yaml") from None
        raise error(f"cannot list NodeResourceTopology objects: {exc.status} {exc.reason}") from None


def _attrs(items: Optional[List[Dict[str, str]]]) -> Dict[str, str]:
    return {a.get("name"): a.get("value") for a in items or []}


def to_report(nrt: Mapping[str, Any]):
    """An NRT object as the placement core's ``NodeReport`` (available resources per zone)."""
    from agent.k8s.pods import quantity
    from cluster.placement.model import NodeReport, PlacementError, Zone

    name = (nrt.get("metadata") or {}).get("name")
    if not name:
        raise PlacementError("a NodeResourceTopology without metadata.name")
    zones = []
    for zone in sorted(nrt.get("zones") or [], key=lambda z: _zone_order(z.get("name", ""))):
        if zone.get("type") not in ("Node", "NUMA"):
            continue
        free = {r.get("name"): r.get("available", "0") for r in zone.get("resources") or []}
        try:
            zones.append(Zone(int(round(quantity(free.get("cpu", "0")) * 1000)), int(quantity(free.get("memory", "0"))),
                              int(quantity(free.get(GPU_RESOURCE, "0")))))
        except ValueError as exc:
            raise PlacementError(f"NodeResourceTopology {name}: {exc}") from None
    attributes = _attrs(nrt.get("attributes"))
    updated = attributes.get("tidal.io/updated")
    epoch = 0.0
    if updated:
        try:
            epoch = float(calendar.timegm(time.strptime(updated, "%Y-%m-%dT%H:%M:%SZ")))
        except ValueError:
            epoch = 0.0
    if not zones:
        raise PlacementError(f"NodeResourceTopology {name}: no NUMA zones")
    return NodeReport(name, zones, reclaimed_millicpu=int(attributes.get("tidal.io/reclaimed-millicpu", 0) or 0),
                      reclaimed_memory=int(attributes.get("tidal.io/reclaimed-memory", 0) or 0),
                      state=attributes.get("tidal.io/node-state", "Online"), updated=epoch or 1.0,
                      policy=attributes.get("tidal.io/policy", ""), attributes=attributes)


def _zone_order(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 10 ** 6

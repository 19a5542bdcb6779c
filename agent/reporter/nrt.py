"""The node's topology report: the figures of a NodeResourceTopology, from the agent's state.

The shape is ``contracts.nrt`` (shared with the extender). The figures, one
zone per NUMA node with cpus:

* ``cpu``: capacity = the zone's online cpus; allocatable = less the reserved
  (system) cpus; available = less cpus held by dedicated workloads (their
  ``qrm.assignment``) and the zone's share of shared workloads' requests
  (millicores).
* ``memory``: capacity = allocatable = the zone's memory; available = less
  the memory requested by NUMA-bound pods (split over their NUMA nodes).
* ``nvidia.com/gpu`` where the zone has GPUs: less those allocated.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from agent.qrm.assignment import assignment
from agent.qrm.model import QoS
from contracts.nrt import (FINGERPRINT, FINGERPRINT_METHOD, TOPOLOGY_POLICY, TOPOLOGY_SCOPE, UPDATED, ZoneFigures,
                           encode, pods_fingerprint, rfc3339)


def build_nrt(node: str, topology, state, pools, pod_memory: Mapping[str, int], reclaimed_millicpu: int,
              reclaimed_memory: int, node_state: str, pod_uids: Iterable[str], now: Optional[float] = None,
              policy: str = "tidal-qrm", counted_pods: Iterable[Tuple[str, str]] = (),
              topology_policy: str = "none", cluster_policy: str = "none") -> Dict[str, Any]:
    """``pod_memory``: workload name -> bytes requested (for NUMA-bound workloads' zones);
    ``pod_uids``: the admitted pods; ``counted_pods``: (namespace, name) of every pod on the node the
    upstream plugin counts (``contracts.nrt.counted_by_the_plugin``), for the fingerprint;
    ``cluster_policy``: ``<name>/<generation>`` of the TidalPolicy the node follows ("none": its own settings)."""
    now = time.time() if now is None else now
    pod_uids = list(pod_uids)
    reserved = set(pools.reserved)
    shared_cpus = set(pools.shared)
    shared_request = sum(a.millicpu for a in state.allocations if a.qos is QoS.SHARED)
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
    zones: List[ZoneFigures] = []
    online = set(topology.online_cpus())
    for numa in (n for n in topology.numa_nodes if n.cpus):
        cpus = set(numa.cpus) & online
        allocatable = len(cpus - reserved)
        shared_here = shared_request * len(cpus & shared_cpus) / total_shared
        memory = int(numa.memory_bytes or 0)
        gpus = sum(1 for g in topology.gpus if g.numa == numa.id)
        zones.append(ZoneFigures(
            numa=numa.id, cpus=len(cpus), cpus_allocatable=allocatable,
            available_millicpu=max(0, allocatable * 1000 - dedicated.get(numa.id, 0) * 1000 - int(round(shared_here))),
            memory=memory, memory_available=max(0, int(memory - memory_used.get(numa.id, 0))),
            gpus=gpus, gpus_available=max(0, gpus - gpu_used.get(numa.id, 0)),
            costs=tuple((other, int(dist)) for other, dist in numa.distances)))
    attributes = [
        # Tidal binds per pod (all of a pod's containers on the same cpus and NUMA nodes): scope "pod"
        (TOPOLOGY_POLICY, topology_policy),
        (TOPOLOGY_SCOPE, "pod"),
        ("tidal.io/policy", policy),
        ("tidal.io/cluster-policy", cluster_policy),
        (FINGERPRINT, pods_fingerprint(counted_pods)),
        (FINGERPRINT_METHOD, "all"),
        ("tidal.io/pods", ",".join(sorted(pod_uids))),
        (UPDATED, rfc3339(now)),
        ("tidal.io/node-state", node_state),
        ("tidal.io/reclaimed-millicpu", str(int(reclaimed_millicpu))),
        ("tidal.io/reclaimed-memory", str(int(reclaimed_memory))),
    ]
    return encode(node, zones, attributes)

"""The NodeResourceTopology (``topology.node.k8s.io/v1alpha2``): encoding and decoding.

The format the upstream scheduler-plugins NodeResourceTopologyMatch plugin
reads, and Tidal's extender too. One zone per NUMA node with cpus, named
``node-N``, type ``Node``, with ``cpu``, ``memory`` and (where the zone has
GPUs) ``nvidia.com/gpu``: capacity, allocatable, available; costs are the
NUMA distances to every zone. What the numbers are is the agent's reporter's
business (``agent.reporter.nrt``); this module is only the shape, so the
agent that writes a report and the extender that reads it agree by
construction.

Top-level attributes: ``topologyManagerPolicy`` and ``topologyManagerScope``
(the node's policy as the kubelet's Topology Manager would state it: the
upstream plugin filters only on ``single-numa-node``), ``tidal.io/policy``,
``nodeTopologyPodsFingerprint`` (upstream's algorithm over the pods the plugin
counts on the node) with ``nodeTopologyPodsFingerprintMethod``,
``tidal.io/pods`` (the admitted pods' UIDs: the extender drops its reservation
for a pod once the report has it),
``tidal.io/updated`` (when the agent made the report: stale reports are not
trusted), ``tidal.io/node-state`` (lending) and the reclaimed capacity.
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import xxhash

from contracts.pods import quantity
from contracts.reports import NodeReport, PlacementError, Zone
from contracts.states import ONLINE

GROUP, VERSION, PLURAL = "topology.node.k8s.io", "v1alpha2", "noderesourcetopologies"
GPU_RESOURCE = "nvidia.com/gpu"
UPDATED = "tidal.io/updated"
FINGERPRINT = "nodeTopologyPodsFingerprint"
FINGERPRINT_METHOD = "nodeTopologyPodsFingerprintMethod"
FINGERPRINT_PREFIX = "pfp0v001"
# the kubelet Topology Manager's policies, as NodeResourceTopology attributes carry them
TOPOLOGY_POLICY = "topologyManagerPolicy"
TOPOLOGY_SCOPE = "topologyManagerScope"
TOPOLOGY_POLICIES = ("none", "best-effort", "restricted", "single-numa-node")


@dataclass(frozen=True)
class ZoneFigures:
    """One NUMA zone's figures as the agent computed them."""

    numa: int
    cpus: int  # capacity: online cpus
    cpus_allocatable: int  # less the reserved (system) cpus
    available_millicpu: int
    memory: int  # capacity = allocatable
    memory_available: int
    gpus: int = 0
    gpus_available: int = 0
    costs: Tuple[Tuple[int, int], ...] = ()  # (other NUMA node, distance)


def rfc3339(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def pods_fingerprint(pods: Iterable[Tuple[str, str]]) -> str:
    """The upstream pod-set fingerprint (k8stopologyawareschedwg/podfingerprint ``pfp0v001``), which
    the NodeResourceTopologyMatch plugin's overreserve cache recomputes from the pods it sees on the
    node and compares before it trusts a report: each pod's ``(namespace, name)`` as
    xxh64(name, seed=xxh64(namespace)), the values sorted and hashed again as little-endian
    64-bit words; the hex of that xxh64 after ``pfp0v001``."""
    words = sorted(xxhash.xxh64_intdigest(name.encode(), seed=xxhash.xxh64_intdigest(namespace.encode()))
                   for namespace, name in pods)
    return FINGERPRINT_PREFIX + xxhash.xxh64(b"".join(w.to_bytes(8, "little") for w in words)).hexdigest()


def counted_by_the_plugin(pod: Mapping[str, Any]) -> bool:
    """Whether the plugin's pod informer (its default ``informerMode: Dedicated``) counts the pod in
    a node's fingerprint: bound and not Pending (Succeeded and Failed pods count until deleted)."""
    return bool((pod.get("spec") or {}).get("nodeName")) and (pod.get("status") or {}).get("phase") != "Pending"


def cpu_quantity(millicpu: int) -> str:
    """Whole cpus where the value is whole ("14", not "14000m": the plugin logs the latter as 0)."""
    return str(millicpu // 1000) if millicpu % 1000 == 0 else f"{millicpu}m"


def encode(node: str, zones: Sequence[ZoneFigures], attributes: Sequence[Tuple[str, str]]) -> Dict[str, Any]:
    """The NRT object for ``node`` (attributes in the order given)."""
    encoded: List[Dict[str, Any]] = []
    for z in zones:
        resources = [
            {"name": "cpu", "capacity": str(z.cpus), "allocatable": str(z.cpus_allocatable),
             "available": cpu_quantity(z.available_millicpu)},
            {"name": "memory", "capacity": str(z.memory), "allocatable": str(z.memory),
             "available": str(z.memory_available)},
        ]
        if z.gpus:
            resources.append({"name": GPU_RESOURCE, "capacity": str(z.gpus), "allocatable": str(z.gpus),
                              "available": str(z.gpus_available)})
        zone: Dict[str, Any] = {"name": f"node-{z.numa}", "type": "Node", "resources": resources}
        if z.costs:
            zone["costs"] = [{"name": f"node-{other}", "value": int(dist)} for other, dist in z.costs]
        encoded.append(zone)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeResourceTopology",
            "metadata": {"name": node, "labels": {"app.kubernetes.io/managed-by": "tidal"}},
            "zones": encoded, "attributes": [{"name": k, "value": v} for k, v in attributes]}


def attributes_of(nrt: Mapping[str, Any]) -> Dict[str, str]:
    return {a.get("name"): a.get("value") for a in nrt.get("attributes") or []}


def decode(nrt: Mapping[str, Any]) -> NodeReport:
    """An NRT object as the placement core's ``NodeReport`` (available resources per zone)."""
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
    attributes = attributes_of(nrt)
    updated = attributes.get(UPDATED)
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
                      state=attributes.get("tidal.io/node-state", ONLINE), updated=epoch or 1.0,
                      policy=attributes.get("tidal.io/policy", ""), attributes=attributes)


def attribute(nrt: Mapping[str, Any], name: str, default: Optional[str] = "0") -> Optional[str]:
    return attributes_of(nrt).get(name, default)


def _zone_order(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 10 ** 6

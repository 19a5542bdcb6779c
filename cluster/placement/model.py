"""What the cluster module places and what it knows of each node.

A node is known by its topology report (the NodeResourceTopology of the
Kubernetes issue, read by ``cluster.nrt``): per NUMA zone the cpu (millicores),
memory (bytes) and GPUs still available to online work, plus the node's
reclaimed capacity (what offline may use now) and its lending state.

A pod is a ``PodSpec``: its QoS kind, its request, and for ``dedicated`` pods
whether it must sit inside one NUMA zone. Identical pods are placed together
as one scheduling unit (``Placer.place(spec, count)``), Gödel's idea: the fit
of the unit is worked out once per node, not once per pod.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from contracts.reports import NodeReport, PlacementError, Zone  # noqa: F401 - what the placement core reads
from contracts.states import STATES  # noqa: F401

KINDS = ("dedicated", "shared", "reclaimed")


@dataclass(frozen=True)
class PodSpec:
    kind: str
    millicpu: int
    memory: int = 0
    gpus: int = 0
    numa_bound: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlacementError(f"pod kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.millicpu <= 0 or self.memory < 0 or self.gpus < 0:
            raise PlacementError(f"pod request cpu={self.millicpu}m memory={self.memory} gpus={self.gpus}: "
                                 f"cpu must be above zero, memory and GPUs not negative")
        if self.numa_bound and self.kind != "dedicated":
            raise PlacementError("numa_bound applies to dedicated pods only")
        if self.kind == "dedicated" and self.millicpu % 1000:
            raise PlacementError(f"dedicated pods take whole cpus: {self.millicpu}m is not a multiple of 1000")
        if self.gpus and self.kind != "dedicated":
            raise PlacementError("GPUs go to dedicated pods only")


@dataclass(frozen=True)
class Placement:
    """Where ``count`` pods of one unit went: node index and (NUMA-bound) zone per pod group."""

    spec: PodSpec
    requested: int
    nodes: List[Tuple[int, Optional[int], int]]  # (node index, zone or None, pods)

    @property
    def placed(self) -> int:
        return sum(n for _, _, n in self.nodes)

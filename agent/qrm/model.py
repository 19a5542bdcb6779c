"""The QoS resource manager's data: levels, requests, allocations, pools.

QoS levels (docs/architecture.md "The model"):

* ``system_cores``: runs on the reserved pool; never handed to anyone else.
* ``dedicated_cores``: exclusive cpus (whole physical cores when the count
  allows), optionally NUMA-bound (cpus and memory of one node, or of the
  fewest whole nodes when larger than one) and NUMA-exclusive.
* ``shared_cores``: millicores served from the shared pool.
* ``reclaimed_cores``: millicores served from the reclaim pool, revocable,
  evicted by tier (``low`` first, then ``min``, then ``high``).

Everything here is immutable; the policy returns new values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from contracts import eviction


class QoS(str, enum.Enum):
    SYSTEM = "system_cores"
    DEDICATED = "dedicated_cores"
    SHARED = "shared_cores"
    RECLAIMED = "reclaimed_cores"


class Tier(str, enum.Enum):
    """Eviction tiers of reclaimed work; ``low`` is evicted first."""

    HIGH = "high"
    MIN = "min"
    LOW = "low"


EVICTION_ORDER = tuple(Tier(t) for t in eviction.EVICTION_ORDER)  # contracts.eviction's

# Workload sources: each decides when its workloads are gone. A local workload (the API,
# ``tidal run``) is gone when its cgroup in Tidal's tree stayed empty; a Kubernetes pod
# when the API server says it was deleted or finished, never because a Tidal cgroup is
# empty (its processes live in the kubelet's cgroups).
LOCAL = "local"
KUBERNETES = "kubernetes"
SOURCES = (LOCAL, KUBERNETES)


@dataclass(frozen=True)
class Request:
    """What a workload asks for (already validated by ``requests.parse_request``)."""

    name: str
    qos: QoS
    cpus: int = 0  # dedicated: whole cpus
    millicpu: int = 0  # shared / reclaimed (dedicated: cpus * 1000)
    numa_binding: bool = False
    numa_exclusive: bool = False
    single_numa_node: bool = False  # NUMA-bound to one node only (the node's single-numa-node policy)
    require_whole_cores: bool = False
    reclaim_allowed: bool = False
    tier: Tier = Tier.LOW
    gpus: int = 0
    nic: Optional[str] = None
    label: Optional[str] = None  # what a person knows the workload by, where its name is an id (a pod's)
    limit_millicpu: Optional[int] = None  # shared_cores: a cpu quota (cpu.max), with burst (CgroupOptions)


@dataclass(frozen=True)
class Allocation:
    """A request as admitted: what the state keeps for each workload.

    ``cpus`` holds a dedicated workload's exclusive cpus; shared, reclaimed and
    system workloads run on their pool's cpus, which the state derives
    (``policy.pools``) rather than stores, so a pool resize never has to
    rewrite every allocation. ``nodes`` are NUMA nodes taken whole (a
    multi-node or ``numa_exclusive`` binding): nobody else's dedicated or
    shared cpus may sit on them.
    """

    name: str
    qos: QoS
    millicpu: int
    cpus: Tuple[int, ...] = ()
    mems: Tuple[int, ...] = ()
    nodes: Tuple[int, ...] = ()
    gpus: Tuple[str, ...] = ()
    numa_binding: bool = False
    numa_exclusive: bool = False
    reclaim_allowed: bool = False
    tier: Tier = Tier.LOW
    source: str = LOCAL  # who decides when it is gone (see SOURCES)
    owner: Optional[int] = None  # the uid that admitted it through the socket; None: root (agent.authority)
    label: Optional[str] = None  # a pod's namespace/name (its name is pod/<uid>)
    limit_millicpu: Optional[int] = None  # shared_cores: its cpu quota, where it asked for one

    def to_dict(self) -> Dict[str, object]:
        return {
            "name": self.name, "qos": self.qos.value, "millicpu": self.millicpu, "cpus": list(self.cpus),
            "mems": list(self.mems), "nodes": list(self.nodes), "gpus": list(self.gpus),
            "numa_binding": self.numa_binding, "numa_exclusive": self.numa_exclusive,
            "reclaim_allowed": self.reclaim_allowed, "tier": self.tier.value, "source": self.source,
            "owner": self.owner, **({"label": self.label} if self.label is not None else {}),
            **({"limit_millicpu": self.limit_millicpu} if self.limit_millicpu is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: Dict[str, object]) -> "Allocation":
        return cls(
            name=str(data["name"]), qos=QoS(data["qos"]), millicpu=int(data["millicpu"]),
            cpus=tuple(int(c) for c in data.get("cpus", ())), mems=tuple(int(m) for m in data.get("mems", ())),
            nodes=tuple(int(n) for n in data.get("nodes", ())), gpus=tuple(str(g) for g in data.get("gpus", ())),
            numa_binding=bool(data.get("numa_binding", False)), numa_exclusive=bool(data.get("numa_exclusive", False)),
            reclaim_allowed=bool(data.get("reclaim_allowed", False)), tier=Tier(data.get("tier", "low")),
            source=str(data.get("source", LOCAL)),
            owner=None if data.get("owner") is None else int(data["owner"]),
            label=None if data.get("label") is None else str(data["label"]),
            limit_millicpu=None if data.get("limit_millicpu") is None else int(data["limit_millicpu"]),
        )


@dataclass(frozen=True)
class Rejection:
    """A request that cannot be admitted now; ``reason`` is one clear line."""

    name: str
    reason: str


@dataclass(frozen=True)
class Pools:
    """The node's cpus split by pool (disjoint; together every online cpu).

    ``dedicated`` holds exclusive cpus; ``reclaimed`` is where reclaimed work
    may run and includes the dedicated cpus of owners that allow it
    (``lendable``), so it overlaps ``dedicated`` there; ``idle`` are cpus of
    whole-node bindings that nobody uses and that the reclaim target left out;
    ``held_back`` are cpus that reclaimed work would have (free, held or lent)
    but may not use: SMT siblings of dedicated cpus (``policy.pools``).
    """

    reserved: Tuple[int, ...]
    shared: Tuple[int, ...]
    reclaimed: Tuple[int, ...]
    dedicated: Tuple[int, ...]
    idle: Tuple[int, ...] = ()
    lendable: Tuple[int, ...] = ()
    held_back: Tuple[int, ...] = ()

    def to_dict(self) -> Dict[str, List[int]]:
        return {"reserved": list(self.reserved), "shared": list(self.shared), "reclaimed": list(self.reclaimed),
                "dedicated": list(self.dedicated), "held_back": list(self.held_back)}


Decision = Union[Allocation, Rejection]

"""The node's hardware as immutable data plus queries.

Vocabulary (fixed across Tidal): socket (physical package), die, numa (NUMA
node), l3 (a group of cpus sharing one last-level cache), core (a physical
core, its id unique node-wide), thread/cpu (a logical cpu, the kernel's cpu
number). Ids of sockets, dies, l3 groups and cores are dense (0..n-1) and
numbered in order of their lowest cpu, so they are stable for a given tree and
never collide across sockets (core ids from sysfs repeat per socket). NUMA
ids are the kernel's node numbers (they can have gaps: 0,1,4,5 on POWER).

Nothing downstream re-reads sysfs: allocation, isolation and reporting take a
``Topology`` and ask it questions. Offline cpus are listed (``online=False``)
but belong to no core, socket or NUMA group, because the kernel does not say
where they are until they come online.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from agent.topology.parse import format_cpulist


@dataclass(frozen=True)
class Cpu:
    id: int
    online: bool = True
    core: Optional[int] = None
    socket: Optional[int] = None
    die: Optional[int] = None
    numa: Optional[int] = None
    l3: Optional[int] = None
    siblings: Tuple[int, ...] = ()


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: Tuple[int, ...]
    memory_bytes: Optional[int]
    distances: Tuple[Tuple[int, int], ...] = ()
    online: bool = True

    @property
    def memory_only(self) -> bool:
        return not self.cpus

    def distance_to(self, other: int) -> Optional[int]:
        for node, dist in self.distances:
            if node == other:
                return dist
        return None


@dataclass(frozen=True)
class Gpu:
    pci: str
    vendor: str
    numa: Optional[int]
    model: Optional[str] = None
    memory_bytes: Optional[int] = None
    uuid: Optional[str] = None


@dataclass(frozen=True)
class Nic:
    name: str
    pci: Optional[str]
    numa: Optional[int]
    speed_mbps: Optional[int]
    mac: Optional[str]
    physical: bool


@dataclass(frozen=True)
class Topology:
    cpus: Tuple[Cpu, ...]
    numa_nodes: Tuple[NumaNode, ...]
    gpus: Tuple[Gpu, ...] = ()
    nics: Tuple[Nic, ...] = ()
    cpu_model: Optional[str] = None
    cpu_flags: Tuple[str, ...] = ()
    warnings: Tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        by_id = {c.id: c for c in self.cpus}
        online = tuple(c.id for c in self.cpus if c.online)
        groups: Dict[str, Dict[int, List[int]]] = {"core": {}, "socket": {}, "die": {}, "l3": {}, "numa": {}}
        for cpu in self.cpus:
            if not cpu.online:
                continue
            for kind in groups:
                value = getattr(cpu, kind)
                if value is not None:
                    groups[kind].setdefault(value, []).append(cpu.id)
        cores_by: Dict[str, Dict[int, List[int]]] = {"socket": {}, "die": {}, "l3": {}, "numa": {}}
        for core, members in sorted(groups["core"].items()):
            first = by_id[members[0]]
            for kind in cores_by:
                value = getattr(first, kind)
                if value is not None:
                    cores_by[kind].setdefault(value, []).append(core)
        index = {
            "by_id": by_id,
            "online": online,
            "cpus_of": {k: {g: tuple(v) for g, v in d.items()} for k, d in groups.items()},
            "cores_of": {k: {g: tuple(v) for g, v in d.items()} for k, d in cores_by.items()},
            "numa_by_id": {n.id: n for n in self.numa_nodes},
        }
        object.__setattr__(self, "_index", index)

    # --- queries -----------------------------------------------------------

    def cpu(self, cpu_id: int) -> Cpu:
        return self._index["by_id"][cpu_id]

    def online_cpus(self) -> Tuple[int, ...]:
        return self._index["online"]

    def offline_cpus(self) -> Tuple[int, ...]:
        return tuple(c.id for c in self.cpus if not c.online)

    def core_ids(self) -> Tuple[int, ...]:
        return tuple(sorted(self._index["cpus_of"]["core"]))

    def socket_ids(self) -> Tuple[int, ...]:
        return tuple(sorted(self._index["cpus_of"]["socket"]))

    def die_ids(self) -> Tuple[int, ...]:
        return tuple(sorted(self._index["cpus_of"]["die"]))

    def l3_ids(self) -> Tuple[int, ...]:
        return tuple(sorted(self._index["cpus_of"]["l3"]))

    def numa_ids(self) -> Tuple[int, ...]:
        return tuple(n.id for n in self.numa_nodes)

    def numa_node(self, numa_id: int) -> NumaNode:
        return self._index["numa_by_id"][numa_id]

    def cpus_in_core(self, core: int) -> Tuple[int, ...]:
        return self._index["cpus_of"]["core"].get(core, ())

    def cpus_in_socket(self, socket: int) -> Tuple[int, ...]:
        return self._index["cpus_of"]["socket"].get(socket, ())

    def cpus_in_die(self, die: int) -> Tuple[int, ...]:
        return self._index["cpus_of"]["die"].get(die, ())

    def cpus_in_l3(self, l3: int) -> Tuple[int, ...]:
        return self._index["cpus_of"]["l3"].get(l3, ())

    def cpus_in_numa(self, numa: int) -> Tuple[int, ...]:
        return self._index["cpus_of"]["numa"].get(numa, ())

    def cores_in_socket(self, socket: int) -> Tuple[int, ...]:
        return self._index["cores_of"]["socket"].get(socket, ())

    def cores_in_l3(self, l3: int) -> Tuple[int, ...]:
        return self._index["cores_of"]["l3"].get(l3, ())

    def cores_in_numa(self, numa: int) -> Tuple[int, ...]:
        return self._index["cores_of"]["numa"].get(numa, ())

    def core_of(self, cpu_id: int) -> Optional[int]:
        return self._index["by_id"][cpu_id].core

    def numa_of(self, cpu_id: int) -> Optional[int]:
        return self._index["by_id"][cpu_id].numa

    @property
    def threads_per_core(self) -> int:
        cores = self._index["cpus_of"]["core"]
        return max((len(v) for v in cores.values()), default=1)

    def distance(self, a: int, b: int) -> Optional[int]:
        return self.numa_node(a).distance_to(b)

    # --- serialisation (the JSON contract of `tidal topology --json`) ------

    def to_dict(self) -> Dict[str, Any]:
        return {
            "cpus": [
                {
                    "id": c.id, "core": c.core, "socket": c.socket, "die": c.die,
                    "numa": c.numa, "l3": c.l3, "online": c.online, "siblings": list(c.siblings),
                }
                for c in self.cpus
            ],
            "numa_nodes": [
                {
                    "id": n.id, "cpus": list(n.cpus), "cpulist": format_cpulist(n.cpus),
                    "memory_bytes": n.memory_bytes, "memory_only": n.memory_only, "online": n.online,
                    "distances": {str(k): v for k, v in n.distances},
                }
                for n in self.numa_nodes
            ],
            "gpus": [
                {"pci": g.pci, "vendor": g.vendor, "numa": g.numa, "model": g.model,
                 "memory_bytes": g.memory_bytes, "uuid": g.uuid}
                for g in self.gpus
            ],
            "nics": [
                {"name": n.name, "pci": n.pci, "numa": n.numa, "speed_mbps": n.speed_mbps,
                 "mac": n.mac, "physical": n.physical}
                for n in self.nics
            ],
            "cpu_model": self.cpu_model,
            "cpu_flags": list(self.cpu_flags),
            "summary": {
                "sockets": len(self.socket_ids()), "dies": len(self.die_ids()),
                "numa_nodes": len(self.numa_nodes), "l3_groups": len(self.l3_ids()),
                "cores": len(self.core_ids()), "online_cpus": len(self.online_cpus()),
                "offline_cpus": format_cpulist(self.offline_cpus()),
                "threads_per_core": self.threads_per_core,
            },
            "warnings": list(self.warnings),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Topology":
        """Inverse of ``to_dict`` (extra keys ignored)."""
        return cls(
            cpus=tuple(
                Cpu(id=c["id"], online=c.get("online", True), core=c.get("core"), socket=c.get("socket"),
                    die=c.get("die"), numa=c.get("numa"), l3=c.get("l3"), siblings=tuple(c.get("siblings", ())))
                for c in data["cpus"]
            ),
            numa_nodes=tuple(
                NumaNode(id=n["id"], cpus=tuple(n["cpus"]), memory_bytes=n.get("memory_bytes"),
                         distances=tuple(sorted((int(k), v) for k, v in n.get("distances", {}).items())),
                         online=n.get("online", True))
                for n in data["numa_nodes"]
            ),
            gpus=tuple(Gpu(pci=g["pci"], vendor=g["vendor"], numa=g.get("numa"), model=g.get("model"),
                           memory_bytes=g.get("memory_bytes"), uuid=g.get("uuid")) for g in data.get("gpus", ())),
            nics=tuple(Nic(name=n["name"], pci=n.get("pci"), numa=n.get("numa"), speed_mbps=n.get("speed_mbps"),
                           mac=n.get("mac"), physical=n.get("physical", False)) for n in data.get("nics", ())),
            cpu_model=data.get("cpu_model"),
            cpu_flags=tuple(data.get("cpu_flags", ())),
            warnings=tuple(data.get("warnings", ())),
        )


def group_ids(groups: Iterable[Iterable[int]]) -> Dict[int, int]:
    """Dense ids for groups of cpus, numbered by their lowest cpu.

    ``[[4,5],[0,1]] -> {0: 0, 1: 0, 4: 1, 5: 1}``.
    """
    ordered = sorted((tuple(sorted(g)) for g in groups if g), key=lambda g: g[0])
    result: Dict[int, int] = {}
    for gid, members in enumerate(ordered):
        for cpu in members:
            result[cpu] = gid
    return result

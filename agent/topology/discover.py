"""Discover the node's cpus and NUMA nodes from sysfs/procfs under any root.

Sources (Documentation/admin-guide/cputopology.rst, Documentation/ABI/stable/
sysfs-devices-node, Documentation/ABI/testing/sysfs-devices-system-cpu):

* ``/sys/devices/system/cpu/cpuN/topology/``: ``thread_siblings_list`` or
  ``core_cpus_list`` (or the hex masks ``thread_siblings``/``core_cpus`` on
  old kernels) group threads into cores; ``core_siblings_list`` or
  ``package_cpus_list`` (masks likewise) group cpus into sockets;
  ``die_cpus_list`` into dies. Grouping is by these masks, not by
  ``core_id``/``physical_package_id``: ids repeat (s390 reuses one core_id
  for several cores, ia64 shares a package id across what the masks call
  separate packages, POWER says -1). The ids are the fallback when masks are
  missing, then ``/proc/cpuinfo``'s ``physical id``/``core id``.
* ``cpuN/cache/indexM/{level,type,shared_cpu_list|shared_cpu_map}``: L3 groups.
* ``/sys/devices/system/cpu/online`` (else each ``cpuN/online``): online cpus.
* ``/sys/devices/system/node/nodeN/{cpulist|cpumap,meminfo,distance}``; a
  kernel without ``/sys/devices/system/node`` has one node 0 holding every
  cpu and ``/proc/meminfo``'s memory.

Masks are read once per group: when cpu 0 says its core is {0, 8}, cpu 8 is
not read again (the kernel writes the same mask for every member). This keeps
discovery of a 256-cpu POWER tree to a few hundred reads.
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from agent.errors import TopologyError
from agent.topology.hostfs import HostFS
from agent.topology.model import Cpu, NumaNode, Topology, group_ids
from agent.topology.parse import (
    cpuinfo_model_and_flags,
    cpuinfo_physical_ids,
    iter_cpuinfo,
    parse_cpulist,
    parse_cpumask,
    parse_distances,
    parse_int,
    parse_meminfo_total,
)

CPU_DIR = "/sys/devices/system/cpu"
NODE_DIR = "/sys/devices/system/node"
_CPU_NAME = re.compile(r"^cpu(\d+)$")
_NODE_NAME = re.compile(r"^node(\d+)$")


class _Reader:
    """Reads and parses one tree, collecting warnings."""

    def __init__(self, fs: HostFS) -> None:
        self.fs = fs
        self.warnings: List[str] = []
        self.empty: List[str] = []  # attribute files that exist but hold nothing
        self._found: Dict[Tuple[str, ...], Tuple[str, str]] = {}

    def parsed(self, path: str, parser: Callable[[str], object]):
        text = self.fs.read(path)
        if text is None:
            return None
        try:
            return parser(text)
        except ValueError as exc:
            raise TopologyError(f"{self.fs.path(path)}: {exc}") from None

    def cpuset(self, directory: str, list_name: str, mask_name: str) -> Optional[Tuple[int, ...]]:
        """A cpu set from ``list_name``, else the hex mask ``mask_name``."""
        return self.first_cpuset(directory, ((list_name, mask_name),))

    def first_cpuset(self, directory: str, files: Sequence[Tuple[str, str]]) -> Optional[Tuple[int, ...]]:
        """The cpu set of the first file that exists among ``files`` (list, mask) pairs.

        A kernel writes the same file names for every cpu, so the name that
        answered last time is tried first: a 256-cpu tree costs one open per
        group instead of one per candidate name.
        """
        key = tuple(name for pair in files for name in pair)
        candidates = [(n, parse_cpulist) for n, _ in files] + [(m, parse_cpumask) for _, m in files]
        hit = self._found.get(key)
        if hit is not None:
            candidates.sort(key=lambda c: c[0] != hit[0])
        for name, parser in candidates:
            value = self.parsed(f"{directory}/{name}", parser)
            if value is not None:
                self._found[key] = (name, "")
                return value
        return None

    def integer(self, path: str) -> Optional[int]:
        """An integer attribute; an empty file (captured trees have them, hwloc reads them) is
        unknown, with one warning per discovery, never fatal."""
        text = self.fs.read(path)
        if text is None:
            return None
        if not text.strip():
            self.empty.append(path)
            return None
        try:
            return parse_int(text)
        except ValueError as exc:
            raise TopologyError(f"{self.fs.path(path)}: {exc}") from None


class _LazyCpuinfoIds:
    """``{cpu: (physical id, core id)}`` from /proc/cpuinfo, parsed on first use
    (only trees missing sysfs topology need it; parsing a 256-cpu file costs ms)."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._ids: Optional[Dict[int, Tuple[Optional[int], Optional[int]]]] = None

    def ids(self) -> Dict[int, Tuple[Optional[int], Optional[int]]]:
        if self._ids is None:
            self._ids = cpuinfo_physical_ids(iter_cpuinfo(self._text))
        return self._ids

    def get(self, cpu: int, default):
        return self.ids().get(cpu, default)


def _cpu_ids(reader: _Reader) -> List[int]:
    fs = reader.fs
    ids = sorted(int(m.group(1)) for m in map(_CPU_NAME.match, fs.listdir(CPU_DIR)) if m)
    present = reader.parsed(f"{CPU_DIR}/present", parse_cpulist)
    if present:
        present_set = set(present)
        ids = [c for c in ids if c in present_set]
    return ids


def _online_set(reader: _Reader, cpu_ids: Sequence[int]) -> Set[int]:
    listed = reader.parsed(f"{CPU_DIR}/online", parse_cpulist)
    if listed == ():  # never empty on a kernel (a cpu runs this): an empty file is unknown
        reader.empty.append(f"{CPU_DIR}/online")
    elif listed is not None:
        return set(listed) & set(cpu_ids)
    online = set()
    for cpu in cpu_ids:
        flag = reader.integer(f"{CPU_DIR}/cpu{cpu}/online")
        if flag is None or flag == 1:  # cpu0 often has no `online` file: it cannot be unplugged
            online.add(cpu)
    return online


def _group_by_masks(
    reader: _Reader, cpus: Sequence[int], online: Set[int], files: Sequence[Tuple[str, str]]
) -> Tuple[List[Set[int]], List[int]]:
    """Group cpus by the first mask file pair found; return (groups, cpus without any)."""
    assigned: Set[int] = set()
    groups: List[Set[int]] = []
    missing: List[int] = []
    for cpu in cpus:
        if cpu in assigned:
            continue
        directory = f"{CPU_DIR}/cpu{cpu}/topology"
        members = reader.first_cpuset(directory, files)
        if members is None:
            missing.append(cpu)
            continue
        group = {m for m in members if m in online and m not in assigned}
        group.add(cpu)
        assigned |= group
        groups.append(group)
    return groups, missing


def _group_by_keys(keys: Dict[int, object]) -> List[Set[int]]:
    by_key: Dict[object, Set[int]] = {}
    for cpu, key in keys.items():
        by_key.setdefault(key, set()).add(cpu)
    return list(by_key.values())


def _topology_id(reader: _Reader, cpu: int, name: str) -> Optional[int]:
    value = reader.integer(f"{CPU_DIR}/cpu{cpu}/topology/{name}")
    return value if value is not None and value >= 0 else None


def _sockets(reader: _Reader, online: Sequence[int], online_set: Set[int], cpuinfo_ids) -> List[Set[int]]:
    groups, missing = _group_by_masks(
        reader, online, online_set,
        [("package_cpus_list", "package_cpus"), ("core_siblings_list", "core_siblings")],
    )
    if not missing:
        return groups
    keys: Dict[int, object] = {}
    unknown: List[int] = []
    for cpu in missing:
        pkg = _topology_id(reader, cpu, "physical_package_id")
        if pkg is None:
            pkg = cpuinfo_ids.get(cpu, (None, None))[0]
        if pkg is None:
            unknown.append(cpu)
        else:
            keys[cpu] = pkg
    groups.extend(_group_by_keys(keys))
    if unknown and len(unknown) == len(online):
        reader.warnings.append("no package information for any cpu; assuming one socket")
        return [set(unknown)]
    for cpu in unknown:
        reader.warnings.append(f"cpu{cpu}: no package information; treated as its own socket")
        groups.append({cpu})
    return groups


def _cores(reader: _Reader, online: Sequence[int], online_set: Set[int], socket_of: Dict[int, int],
           cpuinfo_ids) -> List[Set[int]]:
    """Cores by thread-sibling masks, then (socket, core_id), then /proc/cpuinfo.

    AMD family 15h (Bulldozer) lists the two cores of a compute unit as
    thread siblings while giving them distinct ``core_id``s. As hwloc does,
    the first multi-thread group is checked once: if its first two members
    have different core ids, siblings are split by core id everywhere.
    """
    groups, missing = _group_by_masks(
        reader, online, online_set,
        [("core_cpus_list", "core_cpus"), ("thread_siblings_list", "thread_siblings")],
    )
    multi = next((g for g in groups if len(g) > 1), None)
    if multi is not None:
        first, second = sorted(multi)[:2]
        first_id, second_id = _topology_id(reader, first, "core_id"), _topology_id(reader, second, "core_id")
        if first_id is not None and second_id is not None and first_id != second_id:
            split: List[Set[int]] = []
            for group in groups:
                split.extend(_group_by_keys({cpu: _topology_id(reader, cpu, "core_id") for cpu in group}))
            groups = split
    keys: Dict[int, object] = {}
    for cpu in missing:
        core = _topology_id(reader, cpu, "core_id")
        if core is None:
            core = cpuinfo_ids.get(cpu, (None, None))[1]
        if core is None:
            reader.warnings.append(f"cpu{cpu}: no core information; treated as its own core")
            keys[cpu] = ("alone", cpu)
        else:
            keys[cpu] = (socket_of[cpu], core)
    groups.extend(_group_by_keys(keys))
    return groups


def _dies(reader: _Reader, online: Sequence[int], online_set: Set[int], socket_of: Dict[int, int]) -> List[Set[int]]:
    """Dies by ``die_cpus`` masks; one die per socket where the kernel has no
    die information (before Linux 5.3) or says ``die_id`` -1 (arm64)."""
    first = online[0]
    if _topology_id(reader, first, "die_id") is None:
        return _group_by_keys({cpu: socket_of[cpu] for cpu in online})
    groups, missing = _group_by_masks(reader, online, online_set, [("die_cpus_list", "die_cpus")])
    keys: Dict[int, object] = {cpu: (socket_of[cpu], _topology_id(reader, cpu, "die_id")) for cpu in missing}
    groups.extend(_group_by_keys(keys))
    return groups


def _l3_index(reader: _Reader, cache_dir: str, hint: Optional[str]) -> Optional[str]:
    """The ``indexN`` directory of the unified/data level-3 cache, trying ``hint`` first."""
    fs = reader.fs
    names = [n for n in reversed(fs.listdir(cache_dir)) if n.startswith("index")] if hint is None else [hint]
    for name in names:
        directory = f"{cache_dir}/{name}"
        if reader.integer(f"{directory}/level") != 3:
            continue
        if (fs.read(f"{directory}/type") or "").strip() == "Instruction":
            continue
        return name
    return None


def _l3_groups(reader: _Reader, online: Sequence[int], online_set: Set[int]) -> List[Set[int]]:
    """Group cpus by shared L3. Every cpu of a machine numbers its cache
    indexes alike, so the index found for the first cpu is tried first for
    the others (one read to confirm its level) before a full scan."""
    assigned: Set[int] = set()
    groups: List[Set[int]] = []
    hint: Optional[str] = None
    for cpu in online:
        if cpu in assigned:
            continue
        cache_dir = f"{CPU_DIR}/cpu{cpu}/cache"
        index = _l3_index(reader, cache_dir, hint) if hint else None
        if index is None:
            index = _l3_index(reader, cache_dir, None)
        if index is None:
            continue
        hint = index
        members = reader.cpuset(f"{cache_dir}/{index}", "shared_cpu_list", "shared_cpu_map")
        if members is None:
            continue
        group = {m for m in members if m in online_set and m not in assigned}
        group.add(cpu)
        assigned |= group
        groups.append(group)
    return groups


def _numa_nodes(reader: _Reader, online: Sequence[int], all_cpus: Set[int]) -> List[NumaNode]:
    fs = reader.fs
    node_ids = sorted(int(m.group(1)) for m in map(_NODE_NAME.match, fs.listdir(NODE_DIR)) if m)
    if not node_ids:
        memory = reader.parsed("/proc/meminfo", parse_meminfo_total)
        if memory is None:
            reader.warnings.append("no /proc/meminfo: memory of NUMA node 0 unknown")
        return [NumaNode(id=0, cpus=tuple(online), memory_bytes=memory, distances=((0, 10),))]
    online_nodes = reader.parsed(f"{NODE_DIR}/online", parse_cpulist)
    order = list(online_nodes) if online_nodes else node_ids
    online_node_set = set(order)
    online_cpu_set = set(online)
    nodes = []
    for nid in node_ids:
        directory = f"{NODE_DIR}/node{nid}"
        cpus = reader.cpuset(directory, "cpulist", "cpumap") or ()
        cpus = tuple(c for c in cpus if c in online_cpu_set)
        memory = reader.parsed(f"{directory}/meminfo", parse_meminfo_total)
        if memory is None:
            reader.warnings.append(f"NUMA node {nid}: no meminfo; memory unknown")
        row = reader.parsed(f"{directory}/distance", parse_distances) or ()
        distances: Tuple[Tuple[int, int], ...] = ()
        if row:
            if len(row) == len(order):
                distances = tuple(zip(order, row))
            elif len(row) == len(node_ids):
                distances = tuple(zip(node_ids, row))
            else:
                reader.warnings.append(
                    f"NUMA node {nid}: distance row has {len(row)} entries for {len(order)} nodes; ignored")
        nodes.append(NumaNode(id=nid, cpus=cpus, memory_bytes=memory, distances=distances,
                              online=nid in online_node_set))
    return nodes


def _model_and_flags(reader: _Reader, cpuinfo_text: str, use_cpuinfo_lib: bool):
    """The cpu's model and flags: the kernel's (``/proc/cpuinfo``: the flags it lets user space use), and
    py-cpuinfo on a live host only where the kernel names neither (some arm kernels). py-cpuinfo asks
    CPUID from a process of its own: 1.1 s of every agent's start on this project's x86 host, 7 s under
    emulation, for figures the kernel already gives."""
    model, flags = cpuinfo_model_and_flags(iter_cpuinfo(cpuinfo_text))
    if model or flags or not use_cpuinfo_lib:
        return model, flags
    try:
        import cpuinfo  # py-cpuinfo: CPUID on x86, the platform's own sources elsewhere

        info = cpuinfo.get_cpu_info()
        return info.get("brand_raw") or None, tuple(sorted(set(info.get("flags", ()))))
    except Exception as exc:  # noqa: BLE001 - py-cpuinfo raises many kinds; the model stays unknown
        reader.warnings.append(f"/proc/cpuinfo names no cpu model or flags and py-cpuinfo failed ({exc})")
        return None, ()


def discover(fs: HostFS, *, devices: bool = True, use_cpuinfo_lib: Optional[bool] = None) -> Topology:
    """Read the tree under ``fs`` into a ``Topology``.

    1. Check that the root looks like a Linux sysfs/procfs tree.
    2. List cpus (``cpuN`` dirs, limited to ``present``) and which are online;
       without cpu dirs, take the processors of ``/proc/cpuinfo``.
    3. Group online cpus into sockets, cores (unique node-wide) and dies, by
       sibling masks, then ids, then /proc/cpuinfo.
    4. Group online cpus by shared L3 cache.
    5. Read NUMA nodes (cpus, memory, distances); none listed -> one node 0.
    6. Find GPUs and NICs with their NUMA locality (``devices``), enriched
       through NVML on the live host.
    7. Read the cpu model and flags (py-cpuinfo on the live host, else
       /proc/cpuinfo of the tree).

    Raises ``TopologyError`` (naming the file) for a root that is not such a
    tree, an unreadable structural file, or garbage in one. Odd but readable
    trees are discovered with ``warnings``.
    """
    reader = _Reader(fs)
    has_cpu_dir = fs.isdir(CPU_DIR)
    cpuinfo_text = fs.read("/proc/cpuinfo")
    if not has_cpu_dir and cpuinfo_text is None:
        raise TopologyError(
            f"{fs.root}: not a sysfs/procfs tree (neither sys/devices/system/cpu nor proc/cpuinfo exists)")
    cpuinfo_ids = _LazyCpuinfoIds(cpuinfo_text or "")

    cpu_ids = _cpu_ids(reader) if has_cpu_dir else []
    if cpu_ids:
        online_set = _online_set(reader, cpu_ids)
    else:
        cpu_ids = sorted(cpuinfo_ids.ids())
        if not cpu_ids:
            raise TopologyError(f"{fs.path(CPU_DIR)}: no cpuN directories and no processors in /proc/cpuinfo")
        reader.warnings.append("no cpu directories in sysfs; cpus taken from /proc/cpuinfo")
        online_set = set(cpu_ids)
    online = [c for c in cpu_ids if c in online_set]
    if not online:
        raise TopologyError(f"{fs.path(CPU_DIR)}/online: no cpu is online")

    socket_of = group_ids(_sockets(reader, online, online_set, cpuinfo_ids))
    core_groups = _cores(reader, online, online_set, socket_of, cpuinfo_ids)
    core_of = group_ids(core_groups)
    die_of = group_ids(_dies(reader, online, online_set, socket_of))
    l3_of = group_ids(_l3_groups(reader, online, online_set))
    siblings_of = {cpu: tuple(sorted(g)) for g in core_groups for cpu in g}

    numa_nodes = _numa_nodes(reader, online, set(cpu_ids))
    numa_of: Dict[int, int] = {}
    for node in numa_nodes:
        for cpu in node.cpus:
            numa_of.setdefault(cpu, node.id)
    for cpu in online:
        if cpu not in numa_of:
            reader.warnings.append(f"cpu{cpu}: in no NUMA node's cpulist")

    cpus = tuple(
        Cpu(id=c, online=True, core=core_of[c], socket=socket_of[c], die=die_of[c], numa=numa_of.get(c),
            l3=l3_of.get(c), siblings=siblings_of[c])
        if c in online_set else Cpu(id=c, online=False)
        for c in cpu_ids
    )

    gpus, nics = (), ()
    if devices:
        from agent.topology.devices import discover_gpus, discover_nics

        gpus = discover_gpus(fs, numa_nodes, reader.warnings)
        nics = discover_nics(fs, numa_nodes)

    if use_cpuinfo_lib is None:
        use_cpuinfo_lib = fs.is_live
    model, flags = _model_and_flags(reader, cpuinfo_text or "", use_cpuinfo_lib)
    if reader.empty:
        reader.warnings.append(f"{len(reader.empty)} attribute file(s) exist but are empty, read as unknown "
                               f"(first: {fs.path(reader.empty[0])})")

    return Topology(cpus=cpus, numa_nodes=tuple(numa_nodes), gpus=tuple(gpus), nics=tuple(nics),
                    cpu_model=model, cpu_flags=flags, warnings=tuple(reader.warnings))

"""The QRM checkpoint: versioned, checksummed JSON written atomically.

File format (one JSON object)::

    {"version": 1, "policy": "tidal-qrm/v1", "topology": "<fingerprint>",
     "checksum": "sha256:<hex of the canonical JSON of data>",
     "data": {"reserved": [0, 8], "reclaim_cpus": null, "allocations": [...]}}

Writing (``CheckpointStore.save``): temp file in the same directory, write,
fsync, rename over the checkpoint, fsync the directory. A crash at any point
leaves either the old file or the new one; never a torn mix.

Loading (``CheckpointStore.load``) never refuses to start (the kubelet's
"drain the node and delete the file" is what operators hate most):

* missing: an empty state (first start);
* unreadable, not JSON, bad checksum, unknown version, another policy: the
  file is kept as ``<name>.bad-<n>``, one warning, and the state is rebuilt by
  ``recover`` (the isolation layer can read it back from the cgroups) or
  starts empty;
* another topology (a cpu went offline, a node changed): allocations that
  still make sense (their cpus online, no overlaps, reserved still online)
  are kept, the others dropped, one warning naming them; the old file is
  kept as ``.bad-<n>`` too.

One owner writes (the agent's reconcile loop); readers take ``current``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, List, Optional, Tuple

from agent.errors import StateError
from agent.statefiles import Unusable, keep_bad_copy, read_json, write_atomic
from contracts.jsonbound import BoundError, loads_bounded
from agent.qrm.assignment import memory_nodes
from agent.qrm.model import KUBERNETES, SOURCES, Allocation, QoS
from agent.qrm.requests import stored_name_ok
from agent.qrm.policy import POLICY, State, initial_state
from agent.topology import Topology
from agent.topology.parse import format_cpulist

log = logging.getLogger("tidal.state")

VERSION = 1


def topology_fingerprint(topo: Topology) -> str:
    """What allocations depend on: online cpus and their cores and NUMA nodes."""
    parts = [format_cpulist(topo.online_cpus())]
    parts += [f"c{core}:{format_cpulist(topo.cpus_in_core(core))}" for core in topo.core_ids()]
    parts += [f"n{n.id}:{format_cpulist(n.cpus)}" for n in topo.numa_nodes]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def state_to_data(state: State) -> dict:
    return {"reserved": list(state.reserved), "reclaim_cpus": state.reclaim_cpus,
            "reclaim_millicpu": state.reclaim_millicpu, "allocations": [a.to_dict() for a in state.allocations]}


def state_from_data(data: dict) -> State:
    return State(reserved=tuple(int(c) for c in data["reserved"]),
                 reclaim_cpus=None if data.get("reclaim_cpus") is None else int(data["reclaim_cpus"]),
                 reclaim_millicpu=None if data.get("reclaim_millicpu") is None else int(data["reclaim_millicpu"]),
                 allocations=tuple(Allocation.from_dict(a) for a in data["allocations"]))


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def encode(state: State, topo: Topology) -> bytes:
    data = state_to_data(state)
    doc = {"version": VERSION, "policy": POLICY, "topology": topology_fingerprint(topo),
           "checksum": "sha256:" + hashlib.sha256(_canonical(data)).hexdigest(), "data": data}
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


class CorruptCheckpoint(ValueError):
    pass


def decode(raw: bytes) -> Tuple[State, str]:
    """``(state, topology fingerprint)``; ``CorruptCheckpoint`` with the reason otherwise."""
    try:
        doc = loads_bounded(raw, max_depth=8)
    except BoundError as exc:
        raise CorruptCheckpoint(f"not JSON ({exc})") from None
    return decode_doc(doc)


def decode_doc(doc: Any) -> Tuple[State, str]:
    """A decoded checkpoint document as ``(state, topology fingerprint)``."""
    if not isinstance(doc, dict):
        raise CorruptCheckpoint("not a JSON object")
    if doc.get("version") != VERSION:
        raise CorruptCheckpoint(f"version {doc.get('version')!r}, this agent reads {VERSION}")
    if doc.get("policy") != POLICY:
        raise CorruptCheckpoint(f"written by policy {doc.get('policy')!r}, this agent runs {POLICY}")
    data = doc.get("data")
    if not isinstance(data, dict):
        raise CorruptCheckpoint("no data")
    checksum = "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()
    if doc.get("checksum") != checksum:
        raise CorruptCheckpoint("checksum mismatch")
    try:
        return state_from_data(data), str(doc.get("topology", ""))
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise CorruptCheckpoint(f"malformed data ({exc})") from None


def validate(state: State, topo: Topology) -> None:
    """A checksum proves the file is whole, not that it is sane: every field is checked against
    the node (names, cpus and NUMA nodes that exist, no cpu with two owners, known sources,
    numbers in range). ``CorruptCheckpoint`` names the first problem."""
    online = set(topo.online_cpus())
    numa_ids = set(topo.numa_ids())
    if not set(state.reserved) <= online:
        raise CorruptCheckpoint(f"reserved cpus {format_cpulist(state.reserved)} are not all online here")
    for value, name in ((state.reclaim_cpus, "reclaim_cpus"), (state.reclaim_millicpu, "reclaim_millicpu")):
        if value is not None and not 0 <= value < 1 << 40:
            raise CorruptCheckpoint(f"{name} {value} is out of range")
    names = set()
    owner = {c: "the reserved pool" for c in state.reserved}
    for alloc in state.allocations:
        if not stored_name_ok(alloc.name, alloc.source == KUBERNETES):
            raise CorruptCheckpoint(f"workload name {alloc.name[:160]!r} is not one its source gives")
        if alloc.name in names:
            raise CorruptCheckpoint(f"workload {alloc.name!r} appears twice")
        names.add(alloc.name)
        if alloc.source not in SOURCES:
            raise CorruptCheckpoint(f"{alloc.name}: unknown source {alloc.source!r}")
        if not 0 <= alloc.millicpu < 1 << 40:
            raise CorruptCheckpoint(f"{alloc.name}: millicpu {alloc.millicpu} is out of range")
        if alloc.owner is not None and not 0 <= alloc.owner < 1 << 32:
            raise CorruptCheckpoint(f"{alloc.name}: owner uid {alloc.owner} is out of range")
        if alloc.limit_millicpu is not None and (alloc.qos is not QoS.SHARED
                                                 or not 10 <= alloc.limit_millicpu < 1 << 40):
            raise CorruptCheckpoint(f"{alloc.name}: a cpu limit of {alloc.limit_millicpu} millicpu on "
                                    f"{alloc.qos.value} work")
        if not set(alloc.cpus) <= online or not set(alloc.mems) | set(alloc.nodes) <= numa_ids:
            raise CorruptCheckpoint(f"{alloc.name}: cpus or NUMA nodes that this node does not have")
        if alloc.cpus and alloc.qos is not QoS.DEDICATED:
            raise CorruptCheckpoint(f"{alloc.name}: only dedicated workloads hold cpus of their own")
        for cpu in alloc.cpus:
            if cpu in owner:
                raise CorruptCheckpoint(f"cpu {cpu} belongs to both {owner[cpu]} and {alloc.name}")
            owner[cpu] = alloc.name


def salvage(state: State, topo: Topology) -> Tuple[State, List[str]]:
    """Keep the allocations that still make sense on ``topo``; name the dropped ones."""
    online = set(topo.online_cpus())
    reserved = tuple(c for c in state.reserved if c in online)
    if reserved == state.reserved:  # all still online (or none was reserved): kept as it was
        base = State(reserved=reserved, reclaim_cpus=state.reclaim_cpus)
    else:
        base = initial_state(topo, reserved or None, state.reclaim_cpus)
    kept: List[Allocation] = []
    dropped: List[str] = []
    taken = set(base.reserved)
    numa_ids = set(topo.numa_ids())
    every = memory_nodes(topo)
    names = set()
    for alloc in state.allocations:
        if not (alloc.qos is QoS.DEDICATED and alloc.numa_binding):
            # not bound to NUMA nodes: it runs on every node with memory, whatever this node has
            alloc = replace(alloc, mems=every)
        cpus = set(alloc.cpus)
        ok = (cpus <= online and not (cpus & taken) and set(alloc.mems) <= numa_ids and set(alloc.nodes) <= numa_ids
              and stored_name_ok(alloc.name, alloc.source == KUBERNETES) and alloc.name not in names
              and alloc.source in SOURCES
              and (not cpus or alloc.qos is QoS.DEDICATED))
        if alloc.qos is QoS.DEDICATED and alloc.numa_binding and ok:
            ok = all(topo.cpu(c).numa in alloc.mems for c in cpus)
        names.add(alloc.name)
        if ok:
            kept.append(alloc)
            taken |= cpus
        else:
            dropped.append(alloc.name)
    return State(reserved=base.reserved, reclaim_cpus=base.reclaim_cpus, allocations=tuple(kept)), dropped


@dataclass(frozen=True)
class LoadResult:
    state: State
    warnings: Tuple[str, ...]
    source: str  # "checkpoint", "salvaged", "recovered", "empty"


class CheckpointStore:
    """Reads and atomically writes the checkpoint at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._lock = threading.Lock()
        self._current: Optional[State] = None

    @property
    def current(self) -> Optional[State]:
        return self._current

    def _remove_stale_temp_files(self) -> None:
        """Temp files of a writer that died before its rename hold nothing the
        checkpoint lacks (the rename is the commit point)."""
        directory, base = os.path.split(self.path)
        try:
            names = os.listdir(directory or ".")
        except OSError:
            return
        for name in names:
            if name.startswith(base + ".tmp-"):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass

    def _keep_bad_copy(self) -> Optional[str]:
        return keep_bad_copy(self.path)

    def _recover(self, topo: Topology, reserved, recover, exc: Exception) -> "LoadResult":
        kept = self._keep_bad_copy()
        recovered = recover(topo) if recover else None
        state = recovered if recovered is not None else initial_state(topo, reserved)
        how = "rebuilt from the kernel" if recovered is not None else "starting empty"
        warning = f"checkpoint {self.path} unusable ({exc}); kept as {kept}; {how}"
        log.warning(warning)
        self._current = state
        return LoadResult(state, (warning,), "recovered" if recovered is not None else "empty")

    def load(self, topo: Topology, *, reserved=None,
             recover: Optional[Callable[[Topology], Optional[State]]] = None) -> LoadResult:
        """Load, salvage or recover the state (see module docstring). Never raises for bad content."""
        self._remove_stale_temp_files()
        try:
            doc = read_json(self.path)  # a FIFO or directory here is kept aside, never a hang or a stop
        except Unusable as exc:
            return self._recover(topo, reserved, recover, exc)
        if doc is None:
            # no checkpoint: a first start, or one deleted under a running node. The kernel's tree
            # says which: workloads found there are kept (confined), not dropped and moved out
            recovered = recover(topo) if recover else None
            if recovered is not None and recovered.allocations:
                warning = (f"checkpoint {self.path} is missing; rebuilt {len(recovered.allocations)} workloads "
                           f"from the kernel")
                log.warning(warning)
                self._current = recovered
                return LoadResult(recovered, (warning,), "recovered")
            state = initial_state(topo, reserved)
            self._current = state
            return LoadResult(state, (), "empty")
        try:
            state, fingerprint = decode_doc(doc)
        except CorruptCheckpoint as exc:
            return self._recover(topo, reserved, recover, exc)
        if fingerprint == topology_fingerprint(topo):
            try:
                validate(state, topo)
            except CorruptCheckpoint as exc:
                return self._recover(topo, reserved, recover, exc)
        if fingerprint != topology_fingerprint(topo):
            salvaged, dropped = salvage(state, topo)
            kept = self._keep_bad_copy()
            warning = (f"checkpoint {self.path} was written for another topology; kept as {kept}; "
                       f"kept {len(salvaged.allocations)} allocations"
                       + (f", dropped {', '.join(dropped)}" if dropped else ""))
            log.warning(warning)
            self._current = salvaged
            return LoadResult(salvaged, (warning,), "salvaged")
        self._current = state
        return LoadResult(state, (), "checkpoint")

    def save(self, state: State, topo: Topology) -> None:
        """Atomically replace the checkpoint with ``state`` (``statefiles.write_atomic``)."""
        payload = encode(state, topo)
        with self._lock:
            try:
                write_atomic(self.path, payload)
            except StateError as exc:
                raise StateError(f"cannot write checkpoint: {exc}") from None
            self._current = state

"""Every node the scheduler may place on, as numpy arrays: what it has, what is taken, where it is.

Rows are nodes (a removed node's row is reused); columns of ``alloc`` and
``used`` are resources (``cpu`` in millicores, ``memory`` bytes, ``pods``,
then each extended resource as it is first seen: Tidal's reclaimed capacity,
GPUs). ``used`` is what the pods the scheduler knows on the node request
(bound, assumed while their binding is in flight, or nominated by a
preemption), so ``alloc - used`` is what a pod may still take: the kubelet's
own admission rule.

Where a node's agent publishes a NodeResourceTopology report, ``zone_*`` hold
its free cpu, memory and GPUs per NUMA zone less the NUMA-bound pods bound
there that the report does not list yet (the agent lists the pods it has
admitted, ``tidal.io/pods``); ``state`` the lending state, ``updated`` the
report's time. Labels are kept per key as interned value ids, taints as the id
of the node's taint set, so a pod's node selector, required affinity and
tolerations are a few array comparisons over every node at once.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from contracts.reports import NodeReport
from contracts.states import CURRENT_ANNOTATION, ONLINE, STATE_LABEL, STATES
from cluster.scheduler.pods import PodInfo, _amount

BASE = ("cpu", "memory", "pods")
NO_SCHEDULE = ("NoSchedule", "NoExecute")


class NodeTable:
    def __init__(self, capacity: int = 1024, max_zones: int = 8) -> None:
        self.lock = threading.RLock()
        self.version = 0  # bumped by every change that may let a waiting pod fit
        self.shape_version = 0  # bumped when labels, taints, schedulability, state or the node set change
        self.columns: Dict[str, int] = {name: i for i, name in enumerate(BASE)}
        self.names: List[Optional[str]] = []
        self.index: Dict[str, int] = {}
        self.free_rows: List[int] = []
        self._capacity = 0
        self._zones = max_zones
        self.alloc = np.zeros((0, len(BASE)), dtype=np.int64)
        self.used = np.zeros((0, len(BASE)), dtype=np.int64)
        self.alive = np.zeros(0, dtype=bool)
        self.unschedulable = np.zeros(0, dtype=bool)
        self.state = np.zeros(0, dtype=np.int8)
        self.reported = np.zeros(0, dtype=bool)
        self.updated = np.zeros(0, dtype=np.float64)
        self.zone_cpu = np.zeros((0, max_zones), dtype=np.int64)
        self.zone_mem = np.zeros((0, max_zones), dtype=np.int64)
        self.zone_gpu = np.zeros((0, max_zones), dtype=np.int64)
        self.taint_id = np.zeros(0, dtype=np.int32)
        self.taint_sets: List[Tuple[Tuple[str, str, str], ...]] = [()]
        self._taint_index: Dict[Tuple[Tuple[str, str, str], ...], int] = {(): 0}
        self.labels: Dict[str, np.ndarray] = {}  # key -> value id per row (0: no such label)
        self.label_values: Dict[str, Dict[str, int]] = {}
        self.node_labels: List[Dict[str, str]] = []
        self.reports: List[Optional[NodeReport]] = []
        self.numa_held: List[Dict[str, Tuple[int, int, int, int]]] = []  # uid -> (zone, cpu, mem, gpus)
        self.pods_on: List[Set[str]] = []  # uids of the pods counted on each row
        self._grow(capacity)

    # ---- storage ----------------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        old = self._capacity
        if capacity <= old:
            return

        def bigger(array: np.ndarray) -> np.ndarray:
            shape = (capacity,) + array.shape[1:]
            out = np.zeros(shape, dtype=array.dtype)
            out[:old] = array[:old]
            return out

        for name in ("alloc", "used", "alive", "unschedulable", "state", "reported", "updated", "zone_cpu",
                     "zone_mem", "zone_gpu", "taint_id"):
            setattr(self, name, bigger(getattr(self, name)))
        for key in list(self.labels):
            self.labels[key] = bigger(self.labels[key])
        self._capacity = capacity

    def column(self, resource: str) -> int:
        """The column of ``resource``, added (zeros everywhere) when first seen."""
        col = self.columns.get(resource)
        if col is None:
            col = self.columns[resource] = len(self.columns)
            self.alloc = np.concatenate([self.alloc, np.zeros((self._capacity, 1), dtype=np.int64)], axis=1)
            self.used = np.concatenate([self.used, np.zeros((self._capacity, 1), dtype=np.int64)], axis=1)
        return col

    def vector(self, requests: Dict[str, int]) -> np.ndarray:
        """A pod's requests as a row over the columns (new resources get a column)."""
        for name in requests:
            self.column(name)
        out = np.zeros(len(self.columns), dtype=np.int64)
        for name, amount in requests.items():
            out[self.columns[name]] = amount
        return out

    def __len__(self) -> int:
        return len(self.index)

    @property
    def rows(self) -> int:
        """Rows in use or freed (arrays are longer: spare capacity)."""
        return len(self.names)

    def row(self, name: str) -> Optional[int]:
        return self.index.get(name)

    # ---- nodes ------------------------------------------------------------------------------------------
    def set_node(self, node: Dict[str, Any]) -> int:
        """A Node object (added or changed)."""
        meta = node.get("metadata") or {}
        name = meta.get("name")
        with self.lock:
            row = self.index.get(name)
            if row is None:
                row = self.free_rows.pop() if self.free_rows else len(self.names)
                if row == len(self.names):
                    self.names.append(name)
                    self.node_labels.append({})
                    self.reports.append(None)
                    self.numa_held.append({})
                    self.pods_on.append(set())
                else:
                    self.names[row] = name
                    self.node_labels[row], self.reports[row], self.numa_held[row] = {}, None, {}
                    self.pods_on[row] = set()
                    self.used[row] = 0
                if row >= self._capacity:
                    self._grow(max(2 * self._capacity, row + 1))
                self.index[name] = row
                self.alive[row] = True
            spec = node.get("spec") or {}
            status = node.get("status") or {}
            allocatable = status.get("allocatable") or status.get("capacity") or {}
            before = (self.alloc[row].tobytes(), bool(self.unschedulable[row]), int(self.taint_id[row]),
                      self.node_labels[row], int(self.state[row]))
            self.alloc[row] = 0
            for resource, value in allocatable.items():
                try:
                    amount = _amount(resource, value)
                except ValueError:
                    continue
                col = self.column(resource)  # first: a new column replaces the arrays
                self.alloc[row, col] = amount
            self.unschedulable[row] = bool(spec.get("unschedulable"))
            taints = tuple(sorted((t.get("key", ""), t.get("value", "") or "", t.get("effect", ""))
                                  for t in spec.get("taints") or [] if t.get("effect") in NO_SCHEDULE))
            tid = self._taint_index.get(taints)
            if tid is None:
                tid = self._taint_index[taints] = len(self.taint_sets)
                self.taint_sets.append(taints)
            self.taint_id[row] = tid
            self._set_labels(row, meta.get("labels") or {})
            if self.reports[row] is None:
                wanted = (meta.get("annotations") or {}).get(CURRENT_ANNOTATION) or \
                    (meta.get("labels") or {}).get(STATE_LABEL) or ONLINE
                self.state[row] = STATES.index(wanted) if wanted in STATES else 0
            after = (self.alloc[row].tobytes(), bool(self.unschedulable[row]), int(self.taint_id[row]),
                     self.node_labels[row], int(self.state[row]))
            if after != before:  # a heartbeat changes none of these: placement's caches stay good
                if after[1:] != before[1:] or not before[3]:
                    self.shape_version += 1
                self.version += 1
            return row

    def _set_labels(self, row: int, labels: Dict[str, str]) -> None:
        old = self.node_labels[row]
        for key in old:
            if key not in labels:
                self.labels[key][row] = 0
        for key, value in labels.items():
            if old.get(key) == value:
                continue
            array = self.labels.get(key)
            if array is None:
                array = self.labels[key] = np.zeros(self._capacity, dtype=np.int32)
                self.label_values[key] = {}
            ids = self.label_values[key]
            vid = ids.get(value)
            if vid is None:
                vid = ids[value] = len(ids) + 1
            array[row] = vid
        self.node_labels[row] = dict(labels)

    def remove_node(self, name: str) -> None:
        with self.lock:
            row = self.index.pop(name, None)
            if row is None:
                return
            self.alive[row] = False
            self.reported[row] = False
            for key in self.node_labels[row]:
                self.labels[key][row] = 0
            self.names[row] = None
            self.node_labels[row], self.reports[row], self.numa_held[row] = {}, None, {}
            self.pods_on[row] = set()
            self.used[row] = 0
            self.free_rows.append(row)
            self.version += 1
            self.shape_version += 1

    # ---- reports -----------------------------------------------------------------------------------------
    def set_report(self, report: NodeReport) -> None:
        """A node's NodeResourceTopology (its agent's word on zones and lending state)."""
        with self.lock:
            row = self.index.get(report.name)
            if row is None:
                return  # the Node comes first; its report is applied when it arrives (see pending_reports)
            if len(report.zones) > self._zones:
                report = NodeReport(report.name, report.zones[:self._zones], report.reclaimed_millicpu,
                                    report.reclaimed_memory, report.state, report.updated, report.policy,
                                    report.attributes)
            self.reports[row] = report
            if not self.reported[row] or self.state[row] != STATES.index(report.state):
                self.shape_version += 1
            self.reported[row] = True
            self.updated[row] = report.updated
            self.state[row] = STATES.index(report.state)
            listed = set((report.attributes.get("tidal.io/pods") or "").split(","))
            held = self.numa_held[row]
            for uid in [u for u in held if u in listed]:
                del held[uid]  # the report has it in its numbers now
            self._zones_from_report(row)
            self.version += 1

    def remove_report(self, name: str) -> None:
        with self.lock:
            row = self.index.get(name)
            if row is not None:
                self.reports[row] = None
                self.reported[row] = False
                self.zone_cpu[row] = self.zone_mem[row] = self.zone_gpu[row] = 0
                self.version += 1
                self.shape_version += 1

    def _zones_from_report(self, row: int) -> None:
        report = self.reports[row]
        self.zone_cpu[row] = self.zone_mem[row] = self.zone_gpu[row] = 0
        if report is None:
            return
        for z, zone in enumerate(report.zones):
            self.zone_cpu[row, z], self.zone_mem[row, z], self.zone_gpu[row, z] = zone.millicpu, zone.memory, zone.gpus
        for zone, cpu, mem, gpus in self.numa_held[row].values():
            self.zone_cpu[row, zone] -= cpu
            self.zone_mem[row, zone] -= mem
            self.zone_gpu[row, zone] -= gpus

    # ---- pods --------------------------------------------------------------------------------------------
    def add_pod(self, row: int, pod: PodInfo, vector: np.ndarray, zone: Optional[int]) -> None:
        """Count ``pod`` on ``row`` (bound, assumed or nominated): its requests, and its zone when
        NUMA-bound and the report does not list it yet."""
        with self.lock:
            if pod.uid in self.pods_on[row]:
                return
            self.pods_on[row].add(pod.uid)
            self.used[row, :len(vector)] += vector
            report = self.reports[row]
            if pod.numa_bound and zone is not None and report is not None and \
                    pod.uid not in (report.attributes.get("tidal.io/pods") or "").split(","):
                cpu, mem, gpus = pod.numa_need()
                self.numa_held[row][pod.uid] = (zone, cpu, mem, gpus)
                self.zone_cpu[row, zone] -= cpu
                self.zone_mem[row, zone] -= mem
                self.zone_gpu[row, zone] -= gpus

    def remove_pod(self, row: int, uid: str, vector: np.ndarray) -> None:
        with self.lock:
            if uid not in self.pods_on[row]:
                return
            self.pods_on[row].discard(uid)
            self.used[row, :len(vector)] -= vector
            held = self.numa_held[row].pop(uid, None)
            if held is not None:
                zone, cpu, mem, gpus = held
                self.zone_cpu[row, zone] += cpu
                self.zone_mem[row, zone] += mem
                self.zone_gpu[row, zone] += gpus
            self.version += 1

    # ---- masks -------------------------------------------------------------------------------------------
    def label_mask(self, key: str, values: Optional[List[str]], operator: str) -> np.ndarray:
        """Rows whose label ``key`` matches (In, NotIn, Exists, DoesNotExist, Gt, Lt)."""
        n = self._capacity
        array = self.labels.get(key)
        if operator == "Exists":
            return array > 0 if array is not None else np.zeros(n, dtype=bool)
        if operator == "DoesNotExist":
            return array == 0 if array is not None else np.ones(n, dtype=bool)
        if operator in ("In", "NotIn"):
            ids = [self.label_values.get(key, {}).get(v) for v in values or []]
            ids = [i for i in ids if i is not None]
            hit = np.isin(array, ids) if array is not None and ids else np.zeros(n, dtype=bool)
            # NotIn also passes nodes without the label (the API's rule)
            return hit if operator == "In" else ~hit
        if operator in ("Gt", "Lt"):
            if array is None or not values:
                return np.zeros(n, dtype=bool)
            try:
                bound = int(values[0])
            except ValueError:
                return np.zeros(n, dtype=bool)
            numeric = np.zeros(len(self.label_values[key]) + 1, dtype=bool)
            for value, vid in self.label_values[key].items():
                try:
                    number = int(value)
                except ValueError:
                    continue
                numeric[vid] = number > bound if operator == "Gt" else number < bound
            return numeric[array]
        return np.zeros(n, dtype=bool)

    def field_mask(self, key: str, values: Optional[List[str]], operator: str) -> np.ndarray:
        """matchFields: only ``metadata.name`` exists (In / NotIn)."""
        n = self._capacity
        hit = np.zeros(n, dtype=bool)
        if key == "metadata.name":
            for value in values or []:
                row = self.index.get(value)
                if row is not None:
                    hit[row] = True
        return hit if operator == "In" else ~hit

"""All nodes' reports as numpy arrays, updated in place.

Rows are nodes, columns NUMA zones (padded to the widest node with zones of
zero size). A report that arrives rewrites its row (``set_report``); a
placement subtracts what it took (``take``). Filters and scores are array
expressions over these, so one pod unit is checked against 10,000 nodes in a
few vector operations rather than 10,000 Python calls.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional

import numpy as np

from cluster.placement.model import STATES, NodeReport, PlacementError


class ClusterView:
    def __init__(self, reports: Iterable[NodeReport], max_zones: Optional[int] = None) -> None:
        reports = list(reports)
        if not reports:
            raise PlacementError("a cluster view needs at least one node report")
        width = max_zones or max(len(r.zones) for r in reports)
        n = len(reports)
        self.names: List[str] = []
        self.index: Dict[str, int] = {}
        self.cpu = np.zeros((n, width), dtype=np.int64)  # free millicores per zone
        self.mem = np.zeros((n, width), dtype=np.int64)  # free bytes per zone
        self.gpu = np.zeros((n, width), dtype=np.int64)
        self.cpu_cap = np.zeros(n, dtype=np.int64)  # the node's online-allocatable millicores (for scores)
        self.recl_cpu = np.zeros(n, dtype=np.int64)
        self.recl_mem = np.zeros(n, dtype=np.int64)
        self.state = np.zeros(n, dtype=np.int8)  # index into STATES
        self.updated = np.zeros(n, dtype=np.float64)
        for i, report in enumerate(reports):
            if report.name in self.index:
                raise PlacementError(f"node {report.name!r} is reported twice")
            self.names.append(report.name)
            self.index[report.name] = i
            self.set_report(i, report)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def zones(self) -> int:
        return self.cpu.shape[1]

    def node(self, name: str) -> int:
        try:
            return self.index[name]
        except KeyError:
            raise PlacementError(f"unknown node {name!r}") from None

    def set_report(self, i: int, report: NodeReport) -> None:
        if len(report.zones) > self.zones:
            raise PlacementError(f"node {report.name}: {len(report.zones)} zones, the view holds {self.zones}")
        self.cpu[i] = 0
        self.mem[i] = 0
        self.gpu[i] = 0
        for z, zone in enumerate(report.zones):
            if zone.millicpu < 0 or zone.memory < 0 or zone.gpus < 0:
                raise PlacementError(f"node {report.name}: zone {z} reports negative free resources")
            self.cpu[i, z], self.mem[i, z], self.gpu[i, z] = zone.millicpu, zone.memory, zone.gpus
        self.cpu_cap[i] = max(1, int(self.cpu[i].sum()))
        self.recl_cpu[i] = max(0, report.reclaimed_millicpu)
        self.recl_mem[i] = max(0, report.reclaimed_memory)
        self.state[i] = STATES.index(report.state)
        self.updated[i] = report.updated or time.time()

    def update(self, report: NodeReport) -> int:
        """A fresh report of a node already in the view (incremental)."""
        i = self.node(report.name)
        self.set_report(i, report)
        return i

    def fresh(self, now: float, stale_after: Optional[float]) -> np.ndarray:
        if stale_after is None:
            return np.ones(len(self), dtype=bool)
        return self.updated >= now - stale_after

    def check(self) -> None:
        """Invariant: nothing free is negative (a placement never over-commits a zone)."""
        for label, array in (("cpu", self.cpu), ("memory", self.mem), ("gpus", self.gpu),
                             ("reclaimed cpu", self.recl_cpu), ("reclaimed memory", self.recl_mem)):
            if (array < 0).any():
                bad = np.argwhere(array < 0)[0]
                raise AssertionError(f"{label} over-committed on node {self.names[bad[0]]}")

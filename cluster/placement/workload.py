"""Heterogeneous clusters and pod mixes for the placement benchmark and tests.

Node shapes come from the hwloc snapshots' expected readings (real machines:
ARM, AMD, Intel, POWER, s390...; per NUMA node its cpus and memory) when the
fixtures are at hand, plus three common server shapes; each node draws one.
Pods come in units (a Deployment's replicas, a job's tasks): NUMA-bound
dedicated, shared and reclaimed, with sizes drawn per unit.
"""

from __future__ import annotations

import glob
import json
import os
import random
from typing import List, Optional, Tuple

from cluster.placement.model import NodeReport, PodSpec, Zone

GIB = 1 << 30
Shape = List[Tuple[int, int, int]]  # per zone: (cpus, memory bytes, gpus)

SERVER_SHAPES: List[Shape] = [
    [(32, 256 * GIB, 0)] * 4,  # 2 sockets x 2 NUMA x 16 cores x 2 threads
    [(48, 192 * GIB, 0)] * 2,  # 2 x 24 cores x 2 threads
    [(32, 256 * GIB, 4)] * 2,  # a GPU node: 4 GPUs per NUMA node
]


def fixture_shapes(directory: Optional[str] = None) -> List[Shape]:
    directory = directory or os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "hwloc")
    shapes = []
    for path in sorted(glob.glob(os.path.join(directory, "*.expected.json"))):
        with open(path) as handle:
            data = json.load(handle)
        gpus = {}
        for gpu in data.get("gpus", []):
            numa = gpu.get("numa")
            if numa is not None:
                gpus[str(numa)] = gpus.get(str(numa), 0) + 1
        zones = [(len(node["cpus"]), min(int(node["memory_bytes"]), 4096 * GIB), gpus.get(nid, 0))
                 for nid, node in sorted(data["numa"].items(), key=lambda kv: int(kv[0])) if node["cpus"]]
        if zones:
            shapes.append(zones)
    return shapes


def make_cluster(nodes: int, seed: int = 1, shapes: Optional[List[Shape]] = None,
                 now: float = 0.0) -> List[NodeReport]:
    rng = random.Random(seed)
    shapes = shapes or (fixture_shapes() + SERVER_SHAPES)
    weights = [1 if sum(c for c, _, _ in s) < 64 else 3 for s in shapes]  # more big servers than small boxes
    reports = []
    for i in range(nodes):
        shape = rng.choices(shapes, weights)[0]
        zones = [Zone(cpus * 1000, memory, gpus) for cpus, memory, gpus in shape]
        total = sum(z.millicpu for z in zones)
        reports.append(NodeReport(f"node-{i}", zones,
                                  reclaimed_millicpu=int(total * rng.uniform(0.2, 0.5)),
                                  reclaimed_memory=int(sum(z.memory for z in zones) * rng.uniform(0.1, 0.3)),
                                  updated=now))
    return reports


def make_units(pods: int, seed: int = 2, mean_unit: int = 40) -> List[Tuple[PodSpec, int]]:
    """Units of identical pods adding up to ``pods``: 30% NUMA-bound dedicated, 40% shared, 30% reclaimed."""
    rng = random.Random(seed)
    units: List[Tuple[PodSpec, int]] = []
    left = pods
    while left > 0:
        count = min(left, max(1, int(rng.expovariate(1.0 / mean_unit))))
        kind = rng.choices(("dedicated", "shared", "reclaimed"), (3, 4, 3))[0]
        if kind == "dedicated":
            cpus = rng.choice((1, 2, 4, 8))
            spec = PodSpec("dedicated", cpus * 1000, cpus * rng.choice((2, 4)) * GIB, numa_bound=True)
        elif kind == "shared":
            spec = PodSpec("shared", rng.choice((250, 500, 1000, 2000)), rng.choice((1, 2, 4)) * GIB)
        else:
            spec = PodSpec("reclaimed", rng.choice((500, 1000, 2000, 4000)), rng.choice((1, 2, 4)) * GIB)
        units.append((spec, count))
        left -= count
    return units

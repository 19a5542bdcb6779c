"""The comparison for ``tidal bench placement``: the same checks, one pod and one node at a time.

This is how a scheduler framework plugin runs them (kube-scheduler's Filter
then Score per node, stopping after the sampled number of feasible nodes):
plain Python over per-node lists, each pod of a unit placed on its own. Same
state, same fit rules, same sampling size and policy as ``Placer``.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from cluster.placement.model import STATES, PodSpec
from cluster.placement.view import ClusterView

ONLINE, OFFLINE = STATES.index("Online"), STATES.index("Offline")


class LoopPlacer:
    def __init__(self, view: ClusterView, policy: str = "pack", sample: int = 100) -> None:
        self.cpu = view.cpu.tolist()
        self.mem = view.mem.tolist()
        self.gpu = view.gpu.tolist()
        self.cap = view.cpu_cap.tolist()
        self.recl_cpu = view.recl_cpu.tolist()
        self.recl_mem = view.recl_mem.tolist()
        self.state = view.state.tolist()
        self.policy = policy
        self.sample = sample
        self.offset = 0

    def _fits(self, spec: PodSpec, n: int) -> Tuple[bool, Optional[int]]:
        if spec.kind == "reclaimed":
            ok = self.state[n] in (ONLINE, OFFLINE) and self.recl_cpu[n] >= spec.millicpu \
                and self.recl_mem[n] >= spec.memory
            return ok, None
        if self.state[n] != ONLINE:
            return False, None
        if spec.numa_bound:
            best, best_key = None, None
            for z, (c, m, g) in enumerate(zip(self.cpu[n], self.mem[n], self.gpu[n])):
                if c >= spec.millicpu and m >= spec.memory and g >= spec.gpus:
                    key = c if self.policy == "pack" else -c
                    if best_key is None or key < best_key:
                        best, best_key = z, key
            return best is not None, best
        ok = sum(self.cpu[n]) >= spec.millicpu and sum(self.mem[n]) >= spec.memory and sum(self.gpu[n]) >= spec.gpus
        return ok, None

    def _free(self, spec: PodSpec, n: int) -> float:
        if spec.kind == "reclaimed":
            return self.recl_cpu[n]
        return sum(self.cpu[n])

    def place_one(self, spec: PodSpec) -> Optional[Tuple[int, Optional[int]]]:
        total = len(self.cpu)
        found: List[Tuple[float, int, Optional[int]]] = []
        for step in range(total):
            n = (self.offset + step) % total
            ok, zone = self._fits(spec, n)
            if ok:
                free = self._free(spec, n)
                found.append((free if self.policy == "pack" else -free, n, zone))
                if len(found) >= self.sample:
                    break
        if not found:
            return None
        self.offset = (found[-1][1] + 1) % total
        _, n, zone = min(found)
        self._take(spec, n, zone)
        return n, zone

    def _take(self, spec: PodSpec, n: int, zone: Optional[int]) -> None:
        if spec.kind == "reclaimed":
            self.recl_cpu[n] -= spec.millicpu
            self.recl_mem[n] -= spec.memory
            return
        if zone is not None:
            self.cpu[n][zone] -= spec.millicpu
            self.mem[n][zone] -= spec.memory
            self.gpu[n][zone] -= spec.gpus
            return
        for row, amount in ((self.cpu[n], spec.millicpu), (self.mem[n], spec.memory), (self.gpu[n], spec.gpus)):
            for z in sorted(range(len(row)), key=lambda i: -row[i]):
                give = min(row[z], amount)
                row[z] -= give
                amount -= give
                if not amount:
                    break

    def place(self, spec: PodSpec, count: int) -> int:
        placed = 0
        for _ in range(count):
            if self.place_one(spec) is None:
                break
            placed += 1
        return placed

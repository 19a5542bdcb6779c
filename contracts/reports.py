"""What the cluster side knows of a node: its report, as decoded from a NodeResourceTopology.

Per NUMA zone the cpu (millicores), memory (bytes) and GPUs still available
to online work, plus the node's reclaimed capacity (what offline may use now)
and its lending state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from contracts.errors import TidalError
from contracts.states import STATES


class PlacementError(TidalError):
    """A pod spec, a report or a node id is malformed."""


@dataclass(frozen=True)
class Zone:
    """One NUMA node of a report: what is still free for online pods."""

    millicpu: int
    memory: int
    gpus: int = 0


@dataclass
class NodeReport:
    name: str
    zones: List[Zone]
    reclaimed_millicpu: int = 0
    reclaimed_memory: int = 0
    state: str = "Online"
    updated: float = 0.0  # epoch seconds of the report (stale reports are not trusted)
    policy: str = "tidal"
    attributes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise PlacementError(f"node {self.name}: state {self.state!r} is not one of {', '.join(STATES)}")
        if not self.zones:
            raise PlacementError(f"node {self.name}: a report needs at least one NUMA zone")

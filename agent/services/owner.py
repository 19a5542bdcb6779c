"""The one owner of the node's allocation state.

Holds the state, the lock every writer takes, the checkpoint it commits to,
the condition long-pollers wait on, where other sources' workloads live
(``placements``), and the pools of the current state (computed once per
state). Readers that only look take ``view()``: an immutable snapshot they
may keep without the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from agent.qrm.model import Pools
from agent.qrm.policy import State, pools
from agent.qrm.state import CheckpointStore
from agent.topology import Topology


@dataclass(frozen=True)
class StateView:
    """What readers see: one state, its pools, and where workloads of other sources live."""

    topology: Topology
    state: State
    pools: Pools
    placements: Mapping[str, Tuple[str, ...]]


class StateOwner:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.topology: Optional[Topology] = None  # set once discovered
        self.state: Optional[State] = None
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        # where the processes of workloads from other sources live (a pod's cgroups, parent first);
        # a local workload's live in its leaf of Tidal's tree and have no entry here
        self.placements: Dict[str, Tuple[str, ...]] = {}
        self._pools_memo: Tuple[Optional[State], Optional[Pools]] = (None, None)

    def commit(self, state: State) -> None:
        """Checkpoint ``state`` (atomically), then make it current. The caller holds the lock."""
        self.store.save(state, self.topology)
        self.state = state

    def pools(self, state: Optional[State] = None) -> Pools:
        """``pools`` of ``state`` (default: the current one), computed once per state:
        the loop, the API and the guard all ask for it, and it changes only with the state."""
        state = self.state if state is None else state
        if self._pools_memo[0] is not state:
            self._pools_memo = (state, pools(self.topology, state))
        return self._pools_memo[1]

    def view(self) -> StateView:
        with self.lock:
            return StateView(self.topology, self.state, self.pools(), dict(self.placements))

    def notify(self) -> None:
        """Wake everyone waiting for a change (long-polls)."""
        with self.changed:
            self.changed.notify_all()

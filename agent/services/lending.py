"""The lending service: the node's state machine (``agent.lending.NodeLending``) acted on.

A transition (the API's lend/reclaim, or the cluster's label through the
Kubernetes node agent) is started, then acted on at once: capacity, kernel,
long-pollers. Every period ``advance`` moves on when a notice ends, evicting
what the policy says must go. Hooks run outside the agent's lock (see
``NodeLending``): a slow hook never holds up the loop, the API or the guard.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict

from agent.errors import Conflict
from agent.lending import TO_OFFLINE, TO_ONLINE, NodeLending, TransitionError, parse_notice
from agent.qrm.model import QoS
from agent.services.enforcement import Enforcement
from agent.services.eviction import Eviction
from agent.services.harvest import Harvest
from agent.services.owner import StateOwner

log = logging.getLogger("tidal.agent")


def iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int((epoch % 1) * 1000):03d}Z"


class Lending:
    def __init__(self, owner: StateOwner, node: NodeLending, eviction: Eviction, harvest: Harvest,
                 enforcement: Enforcement, online_policy: str) -> None:
        self.owner = owner
        self.node = node
        self.eviction = eviction
        self.harvest = harvest
        self.enforcement = enforcement
        self.online_policy = online_policy
        self._counted: tuple = (None, 0, 0)  # (state, online, reclaimed): a state is never changed in place

    def _split(self, state) -> tuple:
        online = [a for a in state.allocations if a.qos in (QoS.DEDICATED, QoS.SHARED)]
        return online, [a for a in state.allocations if a.qos is QoS.RECLAIMED]

    def advance(self, epoch: float) -> None:
        state = self.owner.state
        if self._counted[0] is not state:  # counted again only when the state changed (every period otherwise)
            online, reclaimed = self._split(state)
            self._counted = (state, len(online), len(reclaimed))
        before = self.node.current
        action = self.node.advance(epoch, self._counted[1], self._counted[2], self.online_policy)
        if action in ("evict-online", "evict-reclaimed"):
            online, reclaimed = self._split(state)
        if action == "evict-online":
            for alloc in online:
                self.eviction.evict(alloc, "the node is being lent and the notice ended", epoch, cause="lending")
            self.node.advance(epoch, 0, len(reclaimed), self.online_policy)
        elif action == "evict-reclaimed":
            for alloc in reclaimed:
                self.eviction.evict(alloc, "the node is taken back and the notice ended", epoch, cause="lending")
            self.node.advance(epoch, len(online), 0, self.online_policy)
        if self.node.current != before:
            log.info("node state %s -> %s", before.state, self.node.current.state)
            self.harvest.refresh(time.monotonic(), epoch)
            self.owner.notify()

    def lend(self, notice: Any) -> Dict[str, Any]:
        return self._transition(self.node.lend, notice)

    def take_back(self, notice: Any) -> Dict[str, Any]:
        return self._transition(self.node.reclaim, notice)

    def _transition(self, move, notice: Any) -> Dict[str, Any]:
        """Start a lending transition, then act on it at once (capacity, kernel, long-pollers)."""
        seconds = parse_notice(notice)
        with self.owner.lock:
            try:
                move(time.time(), seconds)
            except TransitionError as exc:
                raise Conflict(str(exc)) from None
            self.advance(time.time())
            self.harvest.refresh(time.monotonic(), time.time())
            self.owner.changed.notify_all()  # the lock is held; long-pollers see the new node state
            self.enforcement.reconcile()
            return self.doc()

    def doc(self) -> Dict[str, Any]:
        node = self.node.current
        return {"state": node.state, "since": iso(node.since) if node.since else None,
                "deadline": iso(node.deadline) if node.deadline else None, "notice_seconds": node.notice_seconds,
                "online_policy": self.online_policy, "hooks": self.node.hook_results[-10:]}

    def capacity_fields(self) -> Dict[str, Any]:
        """What the node state adds to the capacity answer: the transition's deadline and target."""
        node = self.node.current
        out: Dict[str, Any] = {}
        if node.state == TO_ONLINE:
            out["deadline"] = iso(node.deadline) if node.deadline else None
            out["target"] = {"millicpu": 0, "memory_bytes": 0}
        elif node.state == TO_OFFLINE:
            out["deadline"] = iso(node.deadline) if node.deadline else None
        return out

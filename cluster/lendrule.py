"""THE lending rule: which nodes to lend or take back this period (pure).

The lending controller (``cluster.lending``) runs it on the cluster it
observes every ``--period`` (30 s by default); the tidal-day simulator
(``cluster.simulate``) runs the same function as often, so its figures
describe the shipped behaviour.

Water level = cpu requested by online pods on online nodes or waiting for a
node (a pod the scheduler found no room for is online's demand too) / what
those nodes can allocate. Nodes labelled Offline (lent, or in their lending notice)
are not online; a node being taken back is online at once (it is uncordoned).

1. Inside an online window: take every lent node back. Above ``threshold``:
   take back, in the order given, as many lent nodes as bring the level to
   the threshold (at least one): online needs them now, and each still has
   its notice to serve, so they come back at once rather than one a period.
2. Otherwise, below the threshold with more than one online node: lend one,
   the online node with the fewest online pods (then the lowest name), if the
   others' level stays at or under the threshold without it. Lending is slow
   on purpose: one node a period.
3. Else nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

LEND, TAKE_BACK = "lend", "take back"


@dataclass(frozen=True)
class OnlineNode:
    name: str
    allocatable: float  # cpu the node can allocate (any unit, the same as ``requested``)
    pods: int  # online pods on it (evicted when it is lent)


@dataclass(frozen=True)
class Action:
    kind: str  # LEND or TAKE_BACK
    node: str
    level: float  # the water level it was decided at
    level_without: Optional[float] = None  # lending: the others' level without the node


def level(requested: float, online: Sequence[OnlineNode]) -> float:
    allocatable = sum(n.allocatable for n in online)
    return requested / allocatable if allocatable else 1.0


def decide(requested: float, online: Sequence[OnlineNode], lent: Sequence[Tuple[str, float]], threshold: float,
           must_be_online: bool = False) -> List[Action]:
    """This period's actions (see the module docstring); ``lent``: (name, allocatable) in the
    order to take back."""
    now = level(requested, online)
    if lent and must_be_online:
        return [Action(TAKE_BACK, name, now) for name, _ in lent]
    if lent and now > threshold:
        actions, allocatable = [], sum(n.allocatable for n in online)
        for name, alloc in lent:
            actions.append(Action(TAKE_BACK, name, now))
            allocatable += alloc
            if allocatable and requested / allocatable <= threshold:
                break
        return actions
    if must_be_online or now >= threshold or len(online) <= 1:
        return []
    node = min(online, key=lambda n: (n.pods, n.name))
    rest = sum(n.allocatable for n in online) - node.allocatable
    if rest <= 0 or requested / rest > threshold:
        return []  # lending any node would push the others over the threshold
    return [Action(LEND, node.name, now, requested / rest)]

"""THE headroom rule: what online may need next is its recent peak times (1 + buffer).

Everything offline is offered (the agent's reclaimed capacity, the reclaim
pool's size, the simulator's per-node offline capacity) is what is left
after this estimate. One definition, used by ``agent.reporter.headroom``
(the reclaim pool), ``agent.reporter.capacity`` (the capacity offline agents
are told) and ``cluster.simulate`` (the tidal day), so the simulator's
figures describe the shipped rule. Works on numbers and on numpy arrays.
"""

from __future__ import annotations

DEFAULT_BUFFER = 0.2  # 20% above the recent peak


def online_estimate(peak, buffer: float = DEFAULT_BUFFER):
    """Online's expected need: ``peak`` (over the caller's window) x (1 + ``buffer``)."""
    if buffer < 0:
        raise ValueError(f"buffer {buffer}: must be >= 0")
    return peak * (1.0 + buffer)

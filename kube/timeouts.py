"""Client-side timeouts for every Kubernetes API call Tidal makes.

A watch's ``timeout_seconds`` is the server's. On a connection that dies
quietly (a node losing its route to the API server, a load balancer dropping
state) the Python client otherwise waits forever, and with it the pod watch,
the reports or the lending controller (kubernetes-client/python issues 1148
and 1402). Each call passes ``_request_timeout``: ``CALL`` for ordinary
requests, ``watch(T)`` for a watch the server ends after T seconds, so that a
quiet but healthy watch is never cut short.
"""

from __future__ import annotations

from typing import Tuple

CONNECT_SECONDS = 5.0
READ_SECONDS = 30.0
CALL: Tuple[float, float] = (CONNECT_SECONDS, READ_SECONDS)


def watch(server_timeout: float) -> Tuple[float, float]:
    """(connect, read) for a watch the server closes after ``server_timeout`` seconds."""
    return (CONNECT_SECONDS, float(server_timeout) + READ_SECONDS)

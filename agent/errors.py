"""Typed errors. Each reaches the user as one clear line and a non-zero exit.

Every error Tidal raises on bad input derives from ``TidalError`` so the CLI
can turn it into ``tidal: error: <message>`` and exit code 2 without a
traceback, while genuine bugs still surface with one.
"""


from contracts.errors import TidalError  # noqa: F401 - the base is shared with the cluster side


class TopologyError(TidalError):
    """The host tree cannot be read or makes no sense (names the file)."""


class AdmissionError(TidalError):
    """A request cannot be admitted (bad shape, does not fit, name in use)."""


class StateError(TidalError):
    """A checkpoint cannot be read or written."""


class NotFound(TidalError):
    """No such workload or path (the API answers 404)."""


class Conflict(TidalError):
    """The request clashes with what is there: a name in use, a node in transition (409)."""


class Unfit(TidalError):
    """A valid request that does not fit the node now (422)."""


class Forbidden(TidalError):
    """The caller may not do this (the API answers 403; see ``agent.authority``)."""

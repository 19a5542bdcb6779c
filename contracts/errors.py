"""The base of every expected failure: reaches the user as one line and a non-zero exit.

Every error Tidal raises on bad input derives from ``TidalError`` so the CLI
can turn it into ``tidal: error: <message>`` and exit code 2 without a
traceback, while genuine bugs still surface with one.
"""


class TidalError(Exception):
    """Base of every expected failure (bad input, odd hardware, bad state)."""

    exit_code = 2

"""JSON from untrusted hands, parsed once and bounded.

``loads_bounded(raw)`` is ``json.loads`` that refuses, with ``BoundError``
(a ``ValueError``) and one line saying why, what Python would otherwise take
or fail on in surprising ways: integers of more than ``MAX_INT_DIGITS``
digits (a 400-digit integer overflows ``math.isfinite``, one of 5,000 digits
raises inside the parser), numbers that are not finite (``1e400``,
``NaN``, ``Infinity``), nesting deeper than ``MAX_DEPTH`` (5,000 ``[``
exhaust the parser's recursion), bytes that are not UTF-8. Every reader of
a request body, an annotation holding JSON or a state file goes through it.
"""

from __future__ import annotations

import json
import math
from typing import Any, Union

MAX_DEPTH = 32
MAX_INT_DIGITS = 30


class BoundError(ValueError):
    """JSON that is malformed or over a bound; the message is one line."""


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise BoundError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BoundError(f"number {text[:40]} is out of range")
    return value


def _constant(text: str) -> Any:
    raise BoundError(f"{text} is not a number JSON allows")


def depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (0 for a scalar); iterative, any depth."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def loads_bounded(raw: Union[bytes, str], max_depth: int = MAX_DEPTH) -> Any:
    try:
        value = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except BoundError:
        raise
    except RecursionError:
        raise BoundError(f"nested too deeply (more than {max_depth} levels)") from None
    except UnicodeDecodeError as exc:
        raise BoundError(f"not UTF-8 (byte {exc.start}: {exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise BoundError(f"line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:  # what the parser itself refuses, in words of its own
        raise BoundError(str(exc).splitlines()[0][:200]) from None
    if depth(value) > max_depth:
        raise BoundError(f"nested too deeply (more than {max_depth} levels)")
    return value

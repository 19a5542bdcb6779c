"""The settings that may change while the agent runs, and where each value comes from.

A tunable has a key (its flag's name, as in the config file), a field of the cluster-wide policy
(``TidalPolicy.spec.agent``, camelCase as Kubernetes writes it) and a parser that refuses a bad value
with its reason. ``resolve`` gives each its value by precedence: a flag, then the config file (both
*local*: an operator set them on this node on purpose), then the policy, then the default; ``Agent.tune``
applies a resolution to the running loops.

| key                        | policy field               | what it sets                                        |
|----------------------------|----------------------------|-----------------------------------------------------|
| memory-pressure-threshold  | memoryPressureThreshold    | the memory loop's trigger and eviction's (percent)  |
| cpu-pressure-threshold     | cpuPressureThreshold       | the cpu loop's trigger (percent)                    |
| io-pressure-threshold      | ioPressureThreshold        | the io loop's trigger (percent; v2 with io only)    |
| eviction-grace             | evictionGrace              | seconds before over-committed work is evicted      |
| memory-evict-below         | memoryEvictBelow           | the available-memory watermark (bytes; a quantity)  |
| reclaim-buffer             | reclaimBuffer              | headroom above online's recent peak (a fraction)    |
| lending-notice             | lendingNotice              | the notice of label-driven lending (seconds)        |
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

SIZE_UNITS = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30,
              "t": 1000 ** 4, "ti": 1 << 40}


def _number(value: Any, low: float, high: float, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a number of {unit}, got {value!r}")
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{value!r} is not within {low:g} to {high:g} {unit}")
    return float(value)


def percent(value: Any) -> float:
    return _number(value, 0, 100, "percent")


def seconds(value: Any) -> float:
    return _number(value, 0, 3600, "seconds")


def fraction(value: Any) -> float:
    return _number(value, 0, 4, "(a fraction of online's peak)")


def size(value: Any) -> Optional[int]:
    """A memory size as Kubernetes writes a quantity (``512Mi``, ``1Gi``, ``2G``, bytes), at least 1 MiB."""
    if isinstance(value, int) and not isinstance(value, bool):
        text = str(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"expected a size such as 512Mi or 1Gi, got {value!r}")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGTkmgt]i?)?\s*", text)
    if not match:
        raise ValueError(f"expected a size such as 512Mi or 1Gi, got {value!r}")
    bytes_ = int(float(match.group(1)) * SIZE_UNITS[(match.group(2) or "").lower()])
    if bytes_ < (1 << 20):
        raise ValueError(f"{value!r} is under 1Mi")
    return bytes_


def notice(value: Any) -> float:
    from agent.errors import TidalError
    from agent.lending import parse_notice

    try:
        return _number(parse_notice(value), 0, 86400, "seconds")
    except TidalError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class Tunable:
    key: str  # the flag's name and the config file's key
    field: str  # the policy's spec.agent field
    attr: str  # AgentConfig's field
    parse: Callable[[Any], Any]


TUNABLES: Tuple[Tunable, ...] = (
    Tunable("memory-pressure-threshold", "memoryPressureThreshold", "memory_pressure_threshold", percent),
    Tunable("cpu-pressure-threshold", "cpuPressureThreshold", "cpu_pressure_threshold", percent),
    Tunable("io-pressure-threshold", "ioPressureThreshold", "io_pressure_threshold", percent),
    Tunable("eviction-grace", "evictionGrace", "eviction_grace", seconds),
    Tunable("memory-evict-below", "memoryEvictBelow", "memory_evict_below", size),
    Tunable("reclaim-buffer", "reclaimBuffer", "reclaim_buffer", fraction),
    Tunable("lending-notice", "lendingNotice", "lending_notice", notice),
)
BY_FIELD = {t.field: t for t in TUNABLES}


def from_policy(spec_agent: Any) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """A policy's ``spec.agent`` as {key: parsed value}, and {field: why} for what it refused (an API
    server enforces the CRD's schema first; this is for one that does not, or an older schema)."""
    values: Dict[str, Any] = {}
    refused: Dict[str, str] = {}
    if not isinstance(spec_agent, Mapping):
        return values, ({"agent": "not an object"} if spec_agent is not None else {})
    for field, raw in spec_agent.items():
        tunable = BY_FIELD.get(field)
        if tunable is None:
            refused[str(field)] = "not a setting this agent has"
            continue
        try:
            values[tunable.key] = tunable.parse(raw)
        except ValueError as exc:
            refused[field] = str(exc)
    return values, refused


def resolve(config, local: Iterable[str], policy: Mapping[str, Any]) -> Dict[str, Tuple[Any, str]]:
    """Each tunable's value and its source: ``local`` keys (a flag or the file) keep the config's value,
    then the policy's, then the config's default."""
    local = set(local)
    out: Dict[str, Tuple[Any, str]] = {}
    for t in TUNABLES:
        if t.key in local:
            out[t.key] = (getattr(config, t.attr), "local")
        elif t.key in policy:
            out[t.key] = (policy[t.key], "policy")
        else:
            out[t.key] = (getattr(config, t.attr), "default")
    return out

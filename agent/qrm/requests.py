"""Turn request documents (Tidal's and Katalyst's vocabulary) into ``Request``s.

Accepted shapes (JSON objects)::

    {"name": "web", "qos": "dedicated_cores", "cpus": 4, "numa_binding": true}
    {"name": "api", "qos": "shared_cores", "millicpu": 1500}
    {"name": "batch", "qos": "reclaimed_cores", "millicpu": 2000, "tier": "min"}
    {"name": "k", "katalyst.kubewharf.io/qos_level": "dedicated_cores", "cpus": 2,
     "memory_enhancement": "{\\"numa_binding\\": \\"true\\", \\"numa_exclusive\\": \\"true\\"}"}

Katalyst's enhancement values are JSON strings whose values are the strings
``"true"``/``"false"``, as in its pod annotations; real booleans are accepted
too. Every problem raises ``AdmissionError`` naming the request and field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Mapping

from agent.errors import AdmissionError
from agent.qrm.model import QoS, Request, Tier

KATALYST_QOS = "katalyst.kubewharf.io/qos_level"
KATALYST_ENHANCEMENTS = ("memory_enhancement", "cpu_enhancement", "katalyst.kubewharf.io/memory_enhancement",
                         "katalyst.kubewharf.io/cpu_enhancement")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
KNOWN_KEYS = {"name", "qos", KATALYST_QOS, "cpus", "millicpu", "numa_binding", "numa_exclusive", "single_numa_node",
              "require_whole_cores", "reclaim_allowed", "tier", "gpus", "nic", *KATALYST_ENHANCEMENTS}


def _flag(owner: str, key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise AdmissionError(f"request {owner!r}: {key} must be true or false, got {value!r}")


def _count(owner: str, key: str, value: Any, *, allow_fraction: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdmissionError(f"request {owner!r}: {key} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise AdmissionError(f"request {owner!r}: {key} must be positive, got {value!r}")
    if not allow_fraction and value != int(value):
        raise AdmissionError(f"request {owner!r}: {key} must be a whole number, got {value!r}")
    return value


def _enhancements(owner: str, doc: Mapping[str, Any]) -> Dict[str, bool]:
    result: Dict[str, bool] = {}
    for key in KATALYST_ENHANCEMENTS:
        if key not in doc:
            continue
        raw = doc[key]
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise AdmissionError(f"request {owner!r}: {key} is not JSON: {exc.msg}") from None
        if not isinstance(raw, dict):
            raise AdmissionError(f"request {owner!r}: {key} must be a JSON object")
        for option in ("numa_binding", "numa_exclusive"):
            if option in raw:
                result[option] = _flag(owner, f"{key}.{option}", raw[option])
    return result


def parse_request(doc: Any) -> Request:
    """Validate one request document."""
    if not isinstance(doc, dict):
        raise AdmissionError(f"a request must be a JSON object, got {type(doc).__name__}")
    name = doc.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise AdmissionError(f"request name must match {NAME.pattern}, got {name!r}")
    unknown = sorted(set(doc) - KNOWN_KEYS)
    if unknown:
        raise AdmissionError(f"request {name!r}: unknown field(s) {', '.join(unknown)}")
    level = doc.get("qos", doc.get(KATALYST_QOS))
    if level is None:
        raise AdmissionError(f"request {name!r}: missing qos (one of {', '.join(q.value for q in QoS)})")
    try:
        qos = QoS(level)
    except ValueError:
        raise AdmissionError(
            f"request {name!r}: unknown qos {level!r} (one of {', '.join(q.value for q in QoS)})") from None
    options = _enhancements(name, doc)
    for key in ("numa_binding", "numa_exclusive", "single_numa_node", "require_whole_cores", "reclaim_allowed"):
        if key in doc:
            options[key] = _flag(name, key, doc[key])
    tier = Tier.LOW
    if "tier" in doc:
        try:
            tier = Tier(doc["tier"])
        except ValueError:
            raise AdmissionError(f"request {name!r}: unknown tier {doc['tier']!r} (high, min or low)") from None
        if qos is not QoS.RECLAIMED:
            raise AdmissionError(f"request {name!r}: tier applies to reclaimed_cores only")
    gpus = int(_count(name, "gpus", doc["gpus"])) if "gpus" in doc else 0
    nic = doc.get("nic")
    if nic is not None and not isinstance(nic, str):
        raise AdmissionError(f"request {name!r}: nic must be an interface name")

    if qos is QoS.DEDICATED:
        if "millicpu" in doc and "cpus" not in doc:
            millicpu = _count(name, "millicpu", doc["millicpu"])
            if millicpu % 1000:
                raise AdmissionError(f"request {name!r}: dedicated_cores needs whole cpus, got {millicpu} millicpu")
            cpus = int(millicpu // 1000)
        elif "cpus" in doc:
            value = doc["cpus"]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and value != int(value):
                raise AdmissionError(f"request {name!r}: dedicated_cores needs whole cpus, got {value}")
            cpus = int(_count(name, "cpus", value))
        else:
            raise AdmissionError(f"request {name!r}: dedicated_cores needs cpus")
        if options.get("numa_exclusive") or options.get("single_numa_node"):
            options["numa_binding"] = True  # exclusivity of a node, or one node only, implies binding to it
        return Request(name=name, qos=qos, cpus=cpus, millicpu=cpus * 1000, gpus=gpus, nic=nic,
                       numa_binding=options.get("numa_binding", False),
                       numa_exclusive=options.get("numa_exclusive", False),
                       single_numa_node=options.get("single_numa_node", False),
                       require_whole_cores=options.get("require_whole_cores", False),
                       reclaim_allowed=options.get("reclaim_allowed", False))
    for option in ("numa_binding", "numa_exclusive", "single_numa_node", "require_whole_cores", "reclaim_allowed"):
        if options.get(option):
            raise AdmissionError(f"request {name!r}: {option} applies to dedicated_cores only")
    if gpus:
        raise AdmissionError(f"request {name!r}: gpus apply to dedicated_cores only")
    if qos is QoS.SYSTEM:
        millicpu = int(_count(name, "millicpu", doc["millicpu"])) if "millicpu" in doc else 0
        return Request(name=name, qos=qos, millicpu=millicpu)
    if "cpus" in doc:
        millicpu = round(_count(name, "cpus", doc["cpus"], allow_fraction=True) * 1000)
    elif "millicpu" in doc:
        millicpu = int(_count(name, "millicpu", doc["millicpu"]))
    else:
        raise AdmissionError(f"request {name!r}: {qos.value} needs millicpu (or cpus)")
    return Request(name=name, qos=qos, millicpu=millicpu, tier=tier)


def parse_requests(text: str, source: str = "requests") -> List[Request]:
    """A JSON list of request documents (a repeated name is the policy's to reject)."""
    try:
        docs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AdmissionError(f"{source}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise AdmissionError(f"{source}: {exc}") from None
    except RecursionError:
        raise AdmissionError(f"{source}: JSON nested too deeply") from None
    if not isinstance(docs, list):
        raise AdmissionError(f"{source}: expected a JSON list of requests")
    requests = []
    for index, doc in enumerate(docs):
        try:
            requests.append(parse_request(doc))
        except AdmissionError as exc:
            raise AdmissionError(f"{source}: item {index}: {exc}") from None
    return requests

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

Names: a local workload's name is a directory of Tidal's cgroup tree
(``tidal/shared/<name>``), so it may not be a cgroup control file's name
(``tasks``, ``cgroup.procs``, ``cpu.shares``, ``memory.limit_in_bytes``: any
name whose first dotted part is a controller's). A pod's workload is named
``pod/<uid>`` by its source (``contracts.pods``): no local name can be one,
so no caller can take a pod's name first.

Numbers are bounded by the machine (``Limits``, from its topology): a request
for more cpus, millicpu or GPUs than the node has is refused here, once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from agent.errors import AdmissionError
from agent.qrm.model import QoS, Request, Tier
from contracts.jsonbound import BoundError, loads_bounded
from contracts.pods import POD_WORKLOAD

KATALYST_QOS = "katalyst.kubewharf.io/qos_level"
KATALYST_ENHANCEMENTS = ("memory_enhancement", "cpu_enhancement", "katalyst.kubewharf.io/memory_enhancement",
                         "katalyst.kubewharf.io/cpu_enhancement")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# the first dotted part of a cgroup control file's name, in v1 and v2 (a workload's cgroup is a directory
# beside them); and the files with no dot
CONTROL_PREFIXES = frozenset({"cgroup", "cpu", "cpuacct", "cpuset", "memory", "io", "blkio", "pids", "hugetlb",
                              "rdma", "misc", "net_cls", "net_prio", "devices", "freezer", "perf_event"})
CONTROL_FILES = frozenset({"tasks", "notify_on_release", "release_agent"})


def stored_name_ok(name: str, pod: bool) -> bool:
    """May a checkpoint hold this name? A pod's may also be an older agent's ``<namespace>.<name>``
    (renamed once its pod is listed again); a local one must still pass ``check_name``."""
    try:
        check_name(name, pod)
        return True
    except AdmissionError:
        return pod and bool(NAME.fullmatch(name))


@dataclass(frozen=True)
class Limits:
    """The most any request may ask on this machine."""

    cpus: int = 1 << 16
    gpus: int = 1 << 10


def machine_limits(topo) -> Limits:
    return Limits(cpus=max(1, len(topo.online_cpus())), gpus=len(topo.gpus))


def shown(value: Any, limit: int = 60) -> str:
    """A value from a request as an error line shows it: its repr (one line), cut to ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check_name(name: Any, pod: bool = False) -> str:
    """A workload name, or ``AdmissionError`` saying why not (``pod``: a pod source's ``pod/<uid>``)."""
    if pod:
        if not isinstance(name, str) or not POD_WORKLOAD.fullmatch(name):
            raise AdmissionError(f"pod workload name must match {POD_WORKLOAD.pattern}, got {shown(name)}")
        return name
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise AdmissionError(f"request name must match {NAME.pattern}, got {shown(name)}")
    if name.split(".", 1)[0] in CONTROL_PREFIXES or name in CONTROL_FILES:
        raise AdmissionError(f"request name {name!r} is a cgroup control file's name (its first dotted part "
                             f"may not be a controller's, e.g. cpu., memory., cgroup.; nor tasks)")
    return name
KNOWN_KEYS = {"name", "qos", KATALYST_QOS, "cpus", "millicpu", "numa_binding", "numa_exclusive", "single_numa_node",
              "require_whole_cores", "reclaim_allowed", "tier", "gpus", "nic", "limit_millicpu",
              *KATALYST_ENHANCEMENTS}
PLAIN_KEY = re.compile(r"[\w./-]{1,40}")  # a field name shown as it is in an error; any other, as its repr
POD_KEYS = {"label"}  # only the pod source names these (a pod's namespace/name)
LABEL = re.compile(r"^[a-z0-9][a-z0-9.-]{0,62}/[a-z0-9][a-z0-9.-]{0,252}$")


def _flag(owner: str, key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise AdmissionError(f"request {owner!r}: {key} must be true or false, got {shown(value)}")


def _count(owner: str, key: str, value: Any, most: float, *, allow_fraction: bool = False) -> float:
    """A positive number no larger than ``most`` (the machine's own size); whole unless ``allow_fraction``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdmissionError(f"request {owner!r}: {key} must be a number, got {shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise AdmissionError(f"request {owner!r}: {key} must be a finite number")
    if value <= 0:
        raise AdmissionError(f"request {owner!r}: {key} must be positive, got {shown(value)}")
    if value > most:  # compared before any conversion: a huge integer never reaches float() or int()
        raise AdmissionError(f"request {owner!r}: asks {shown(value)} {key}; this node has {most:g}")
    if not allow_fraction and value != int(value):
        raise AdmissionError(f"request {owner!r}: {key} must be a whole number, got {shown(value)}")
    return value


def _enhancements(owner: str, doc: Mapping[str, Any]) -> Dict[str, bool]:
    result: Dict[str, bool] = {}
    for key in KATALYST_ENHANCEMENTS:
        if key not in doc:
            continue
        raw = doc[key]
        if isinstance(raw, str):
            try:
                raw = loads_bounded(raw)
            except BoundError as exc:
                raise AdmissionError(f"request {owner!r}: {key} is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise AdmissionError(f"request {owner!r}: {key} must be a JSON object")
        for option in ("numa_binding", "numa_exclusive"):
            if option in raw:
                result[option] = _flag(owner, f"{key}.{option}", raw[option])
    return result


def parse_request(doc: Any, limits: Optional[Limits] = None, pod: bool = False) -> Request:
    """Validate one request document (``limits``: the machine's; ``pod``: from the pod source)."""
    if not isinstance(doc, dict):
        raise AdmissionError(f"a request must be a JSON object, got {type(doc).__name__}")
    limits = limits or Limits()
    name = check_name(doc.get("name"), pod)
    unknown = sorted(set(doc) - KNOWN_KEYS - (POD_KEYS if pod else set()))
    if unknown:
        raise AdmissionError(f"request {name!r}: unknown field(s) {', '.join(u if PLAIN_KEY.fullmatch(u) else shown(u, 40) for u in unknown[:8])}")
    label = doc.get("label")
    if label is not None and not (isinstance(label, str) and LABEL.fullmatch(label)):
        raise AdmissionError(f"request {name!r}: label must be <namespace>/<pod name>, got {shown(label)}")
    level = doc.get("qos", doc.get(KATALYST_QOS))
    if level is None:
        raise AdmissionError(f"request {name!r}: missing qos (one of {', '.join(q.value for q in QoS)})")
    try:
        qos = QoS(level)
    except ValueError:
        raise AdmissionError(
            f"request {name!r}: unknown qos {shown(level)} (one of {', '.join(q.value for q in QoS)})") from None
    options = _enhancements(name, doc)
    for key in ("numa_binding", "numa_exclusive", "single_numa_node", "require_whole_cores", "reclaim_allowed"):
        if key in doc:
            options[key] = _flag(name, key, doc[key])
    tier = Tier.LOW
    if "tier" in doc:
        try:
            tier = Tier(doc["tier"])
        except ValueError:
            raise AdmissionError(f"request {name!r}: unknown tier {shown(doc['tier'])} (high, min or low)") from None
        if qos is not QoS.RECLAIMED:
            raise AdmissionError(f"request {name!r}: tier applies to reclaimed_cores only")
    gpus = int(_count(name, "gpus", doc["gpus"], limits.gpus)) if "gpus" in doc else 0
    nic = doc.get("nic")
    if nic is not None and not isinstance(nic, str):
        raise AdmissionError(f"request {name!r}: nic must be an interface name")

    most_millicpu = limits.cpus * 1000
    if "limit_millicpu" in doc and qos is not QoS.SHARED:
        raise AdmissionError(f"request {name!r}: limit_millicpu applies to shared_cores only")
    if qos is QoS.DEDICATED:
        if "millicpu" in doc and "cpus" not in doc:
            millicpu = _count(name, "millicpu", doc["millicpu"], most_millicpu)
            if millicpu % 1000:
                raise AdmissionError(f"request {name!r}: dedicated_cores needs whole cpus, got {millicpu} millicpu")
            cpus = int(millicpu // 1000)
        elif "cpus" in doc:
            value = _count(name, "cpus", doc["cpus"], limits.cpus, allow_fraction=True)
            if value != int(value):
                raise AdmissionError(f"request {name!r}: dedicated_cores needs whole cpus, got {value}")
            cpus = int(value)
        else:
            raise AdmissionError(f"request {name!r}: dedicated_cores needs cpus")
        if options.get("numa_exclusive") or options.get("single_numa_node"):
            options["numa_binding"] = True  # exclusivity of a node, or one node only, implies binding to it
        return Request(name=name, qos=qos, cpus=cpus, millicpu=cpus * 1000, gpus=gpus, nic=nic,
                       numa_binding=options.get("numa_binding", False),
                       numa_exclusive=options.get("numa_exclusive", False),
                       single_numa_node=options.get("single_numa_node", False),
                       require_whole_cores=options.get("require_whole_cores", False),
                       reclaim_allowed=options.get("reclaim_allowed", False), label=label)
    for option in ("numa_binding", "numa_exclusive", "single_numa_node", "require_whole_cores", "reclaim_allowed"):
        if options.get(option):
            raise AdmissionError(f"request {name!r}: {option} applies to dedicated_cores only")
    if gpus:
        raise AdmissionError(f"request {name!r}: gpus apply to dedicated_cores only")
    if qos is QoS.SYSTEM:
        millicpu = int(_count(name, "millicpu", doc["millicpu"], most_millicpu)) if "millicpu" in doc else 0
        return Request(name=name, qos=qos, millicpu=millicpu, label=label)
    if "cpus" in doc:
        millicpu = round(_count(name, "cpus", doc["cpus"], limits.cpus, allow_fraction=True) * 1000)
    elif "millicpu" in doc:
        millicpu = int(_count(name, "millicpu", doc["millicpu"], most_millicpu))
    else:
        raise AdmissionError(f"request {name!r}: {qos.value} needs millicpu (or cpus)")
    limit = None
    if "limit_millicpu" in doc:
        # the kernel's smallest quota is 1 ms a 100 ms period: 10 millicpu
        limit = int(_count(name, "limit_millicpu", doc["limit_millicpu"], most_millicpu))
        if limit < max(10, millicpu):
            raise AdmissionError(f"request {name!r}: limit_millicpu {limit} is below its millicpu {millicpu} "
                                 f"(or the kernel's least quota, 10)")
    return Request(name=name, qos=qos, millicpu=millicpu, tier=tier, label=label, limit_millicpu=limit)


def parse_requests(text: str, source: str = "requests", limits: Optional[Limits] = None) -> List[Request]:
    """A JSON list of request documents (a repeated name is the policy's to reject)."""
    try:
        docs = loads_bounded(text)
    except BoundError as exc:
        raise AdmissionError(f"{source}: malformed JSON: {exc}") from None
    if not isinstance(docs, list):
        raise AdmissionError(f"{source}: expected a JSON list of requests")
    requests = []
    for index, doc in enumerate(docs):
        try:
            requests.append(parse_request(doc, limits))
        except AdmissionError as exc:
            raise AdmissionError(f"{source}: item {index}: {exc}") from None
    return requests

"""A Kubernetes pod as a Tidal request: QoS level and options from annotations, amounts from resources.

Annotations (Tidal's, then Katalyst's as aliases):

| annotation | values |
|---|---|
| ``tidal.io/qos-level`` / ``katalyst.kubewharf.io/qos_level`` | dedicated_cores, shared_cores, reclaimed_cores, system_cores |
| ``tidal.io/numa-binding``, ``tidal.io/numa-exclusive`` | "true" / "false" (dedicated_cores) |
| ``katalyst.kubewharf.io/memory_enhancement`` | JSON ``{"numa_binding": "true", "numa_exclusive": "true"}`` |
| ``tidal.io/tier`` | high, min, low (reclaimed_cores) |

Without a level: a Guaranteed pod with whole cpus -> ``dedicated_cores``; a
pod requesting ``tidal.io/reclaimed-millicpu`` -> ``reclaimed_cores``; any
other pod -> ``shared_cores``. A malformed annotation is reported (the caller
records an event on the pod) and the pod gets this default treatment.

A pod's workload is named ``pod/<uid>`` (``workload_name``), the uid the
kubelet and the runtime know it by (a static pod's is its
``kubernetes.io/config.mirror`` hash, not its mirror's uid): never shortened,
never shared with another pod, and never a name the local API accepts. The NRI
plugin finds a pod's assignment by the same uid. Agents before 0.2 named pods
``<namespace>.<name>`` cut to 128 bytes (``legacy_workload_name``); a
restarted agent renames what its checkpoint holds under that name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from contracts.eviction import TIERS
from contracts.states import RECLAIMED_CPU, RECLAIMED_MEMORY  # noqa: F401 - part of this contract

QOS_LEVEL = "tidal.io/qos-level"
NUMA_BINDING = "tidal.io/numa-binding"
NUMA_EXCLUSIVE = "tidal.io/numa-exclusive"
TIER = "tidal.io/tier"
KATALYST_QOS = "katalyst.kubewharf.io/qos_level"
KATALYST_MEMORY = "katalyst.kubewharf.io/memory_enhancement"
LEVELS = ("dedicated_cores", "shared_cores", "reclaimed_cores", "system_cores")
MIRROR = "kubernetes.io/config.mirror"
POD_WORKLOAD = re.compile(r"^pod/[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}


def quantity(value: Any) -> float:
    """A Kubernetes resource quantity ("500m", "2", "4Gi") as a number (cores, bytes)."""
    match = _QUANTITY.match(str(value).strip())
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"bad quantity {value!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def kubelet_uid(pod: Dict[str, Any]) -> str:
    """The uid the kubelet runs the pod under: a static pod's config hash (its mirror pod's annotation),
    else the pod's own uid. Its cgroups and the runtime's sandbox carry this one."""
    meta = pod.get("metadata") or {}
    mirror = (meta.get("annotations") or {}).get(MIRROR)
    return str(mirror) if mirror else str(meta.get("uid", ""))


def workload_name(uid: str) -> str:
    return f"pod/{uid}"


def legacy_workload_name(pod: Dict[str, Any]) -> str:
    """The name agents before 0.2 gave a pod's workload (kept to adopt their checkpoints)."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}.{meta.get('name', '')}"[:128]


def display_name(pod: Dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"


@dataclass(frozen=True)
class PodRequest:
    """What Tidal admits for a pod, and what it asked for in memory (per-NUMA accounting)."""

    workload: str  # the agent's workload name: pod/<uid>
    uid: str  # the kubelet's uid of the pod (kubelet_uid)
    document: Dict[str, Any]  # a request document for agent.qrm.requests.parse_request
    memory: int  # bytes requested (summed over containers)
    qos_class: str  # Guaranteed, Burstable or BestEffort
    problem: Optional[str] = None  # why annotations were ignored (an event is recorded)


def _resources(pod: Dict[str, Any]) -> Tuple[Dict[str, float], Dict[str, float]]:
    requests: Dict[str, float] = {}
    limits: Dict[str, float] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for target, key in ((requests, "requests"), (limits, "limits")):
            for name, value in (resources.get(key) or {}).items():
                target[name] = target.get(name, 0.0) + quantity(value)
    for name, value in limits.items():  # a limit with no request requests the limit (apiserver defaulting)
        requests.setdefault(name, value)
    return requests, limits


def qos_class(pod: Dict[str, Any]) -> str:
    status = (pod.get("status") or {}).get("qosClass")
    if status:
        return status
    containers = (pod.get("spec") or {}).get("containers") or []
    guaranteed, any_set = True, False
    for container in containers:
        resources = container.get("resources") or {}
        req, lim = resources.get("requests") or {}, resources.get("limits") or {}
        any_set = any_set or bool(req) or bool(lim)
        for name in ("cpu", "memory"):
            if name not in lim or quantity(req.get(name, lim[name])) != quantity(lim[name]):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed and containers else "Burstable"


def _flag(value: Any, key: str) -> bool:
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ValueError(f"{key}: expected \"true\" or \"false\", got {value!r}")
    return text == "true"


def _options(annotations: Dict[str, str]) -> Dict[str, Any]:
    """The annotations' options; raises ValueError naming the bad one."""
    options: Dict[str, Any] = {}
    level = annotations.get(QOS_LEVEL, annotations.get(KATALYST_QOS))
    if level is not None:
        if level not in LEVELS:
            key = QOS_LEVEL if QOS_LEVEL in annotations else KATALYST_QOS
            raise ValueError(f"{key}: unknown level {level!r} (one of {', '.join(LEVELS)})")
        options["qos"] = level
    if KATALYST_MEMORY in annotations:
        try:
            enhancement = json.loads(annotations[KATALYST_MEMORY])
        except json.JSONDecodeError:
            raise ValueError(f"{KATALYST_MEMORY}: not JSON: {annotations[KATALYST_MEMORY]!r}") from None
        if not isinstance(enhancement, dict):
            raise ValueError(f"{KATALYST_MEMORY}: expected a JSON object")
        for key in ("numa_binding", "numa_exclusive"):
            if key in enhancement:
                options[key] = _flag(enhancement[key], f"{KATALYST_MEMORY} {key}")
    for annotation, key in ((NUMA_BINDING, "numa_binding"), (NUMA_EXCLUSIVE, "numa_exclusive")):
        if annotation in annotations:
            options[key] = _flag(annotations[annotation], annotation)
    if TIER in annotations:
        if annotations[TIER] not in TIERS:
            raise ValueError(f"{TIER}: unknown tier {annotations[TIER]!r} (high, min or low)")
        options["tier"] = annotations[TIER]
    return options


def pod_request(pod: Dict[str, Any], topology_policy: str = "none") -> PodRequest:
    """The request for a pod; bad annotations give the default treatment and a ``problem``.
    Under the node's ``single-numa-node`` topology policy a dedicated_cores pod is NUMA-bound,
    whatever its annotations say (the report promises the upstream plugin as much)."""
    meta = pod.get("metadata") or {}
    uid = kubelet_uid(pod)
    name = workload_name(uid)
    requests, limits = _resources(pod)
    qos = qos_class(pod)
    memory = int(requests.get("memory", 0))
    problem = None
    try:
        options = _options(meta.get("annotations") or {})
    except ValueError as exc:
        options, problem = {}, f"ignored annotation {exc}; using the default treatment"
    level = options.pop("qos", None)
    cpu = requests.get("cpu", 0.0)
    if level is None:
        if requests.get(RECLAIMED_CPU):
            level = "reclaimed_cores"
        elif qos == "Guaranteed" and cpu >= 1 and float(cpu).is_integer():
            level = "dedicated_cores"
        else:
            level = "shared_cores"
    doc: Dict[str, Any] = {"name": name, "qos": level, "label": display_name(pod)}
    if level == "dedicated_cores":
        whole = int(cpu) if cpu >= 1 and float(cpu).is_integer() else 0
        if not whole:
            problem = problem or f"dedicated_cores needs whole cpus (requested {cpu:g}); using shared_cores"
            level, options = "shared_cores", {}
            doc["qos"] = level
        else:
            doc["cpus"] = whole
            doc.update({k: v for k, v in options.items() if k in ("numa_binding", "numa_exclusive")})
            if topology_policy == "single-numa-node":
                if options.get("numa_binding") is False:
                    problem = problem or ("numa-binding false ignored: the node's topology policy is "
                                          "single-numa-node; bound to one NUMA node")
                doc["numa_binding"] = doc["single_numa_node"] = True
    if level == "reclaimed_cores":
        millicpu = requests.get(RECLAIMED_CPU) or cpu * 1000
        doc["millicpu"] = max(1, int(millicpu))
        memory = int(requests.get(RECLAIMED_MEMORY, memory))
        if "tier" in options:
            doc["tier"] = options["tier"]
    elif level in ("shared_cores", "system_cores"):
        doc["millicpu"] = max(1, int(round(cpu * 1000)))
    if level != "reclaimed_cores" and "tier" in options:
        problem = problem or f"{TIER} applies to reclaimed_cores only; ignored"
    return PodRequest(name, uid, doc, memory, qos, problem)

"""A pod as the scheduler sees it: what it asks for, where it may go, how it ranks, which unit it is in.

Parsed once from the API's JSON (``PodInfo.parse``) into a record the rest of
the scheduler reads without touching the dict again:

* ``requests``: resource -> integer amount, as the kubelet admits it: the sum
  of the containers' requests (a limit with no request requests the limit),
  at least the largest init container's, plus the pod overhead; cpu in
  millicores, memory in bytes, ``pods`` 1, extended resources (Tidal's
  reclaimed capacity, GPUs) as counts.
* ``kind`` / ``numa_bound`` / ``tier``: the Tidal treatment the node's agent
  will give it (``contracts.pods.pod_request``, the same rule the agent and
  the extender read): a NUMA-bound pod needs one zone of a fresh report.
* ``rank``: who may preempt whom. Every online pod outranks every reclaimed
  pod (reclaimed work is revocable by definition); reclaimed pods rank by
  tier (low < min < high), then priority; online pods by priority.
* ``template``: pods with the same template are interchangeable for
  placement (same requests, constraints, priority and unit kind), so the
  scheduler places a run of them in one vector pass.
* ``group``: the PodGroup (scheduler-plugins' coscheduling label
  ``scheduling.x-k8s.io/pod-group``) whose gang it belongs to.
"""

from __future__ import annotations

import calendar
import json
from typing import Any, Dict, List, Optional, Tuple

from contracts.pods import pod_request, quantity

GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
GROUP_LABEL_OLD = "pod-group.scheduling.sigs.k8s.io"  # scheduler-plugins before v0.24
TIER_RANK = {"low": 0, "min": 1, "high": 2}
# a rank is (online?, tier, priority): reclaimed pods (0, tier, priority), online (1, 0, priority)
Rank = Tuple[int, int, int]


def parse_time(text: Optional[str]) -> float:
    """An RFC 3339 time the API server wrote (``2026-11-26T10:00:00Z``) as epoch seconds; 0 if unreadable.
    By hand: ``time.strptime`` was a tenth of the scheduler's cpu at a thousand pods a second."""
    if not text or len(text) < 19:
        return 0.0
    try:
        return float(calendar.timegm((int(text[0:4]), int(text[5:7]), int(text[8:10]), int(text[11:13]),
                                      int(text[14:16]), int(text[17:19]), 0, 0, 0)))
    except ValueError:
        return 0.0


def _amount(name: str, value: Any) -> int:
    number = quantity(value)
    if name == "cpu":
        return int(round(number * 1000))
    return int(number) if number == int(number) else int(number) + 1


def pod_requests(spec: Dict[str, Any]) -> Dict[str, int]:
    """The pod's requests as the kubelet admits them (see the module docstring)."""
    total: Dict[str, int] = {}
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        requests = dict(resources.get("requests") or {})
        for name, value in (resources.get("limits") or {}).items():
            requests.setdefault(name, value)
        for name, value in requests.items():
            total[name] = total.get(name, 0) + _amount(name, value)
    for container in spec.get("initContainers") or []:
        resources = container.get("resources") or {}
        requests = dict(resources.get("requests") or {})
        for name, value in (resources.get("limits") or {}).items():
            requests.setdefault(name, value)
        for name, value in requests.items():
            total[name] = max(total.get(name, 0), _amount(name, value))
    for name, value in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, 0) + _amount(name, value)
    total["pods"] = 1
    return {k: v for k, v in total.items() if v > 0}


class PodInfo:
    __slots__ = ("uid", "namespace", "name", "node", "scheduler", "priority", "created", "phase", "deleting",
                 "group", "requests", "kind", "numa_bound", "tier", "rank", "node_selector", "affinity",
                 "tolerations", "template", "nominated", "labels", "problem")

    def __init__(self) -> None:
        self.problem: Optional[str] = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def online(self) -> bool:
        return self.kind != "reclaimed"

    @classmethod
    def parse(cls, pod: Dict[str, Any]) -> "PodInfo":
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        status = pod.get("status") or {}
        info = cls()
        info.uid = meta.get("uid", "")
        info.namespace = meta.get("namespace", "default")
        info.name = meta.get("name", "")
        info.labels = meta.get("labels") or {}
        info.node = spec.get("nodeName") or ""
        info.scheduler = spec.get("schedulerName") or "default-scheduler"
        info.priority = int(spec.get("priority") or 0)
        info.created = parse_time(meta.get("creationTimestamp"))
        info.phase = status.get("phase") or "Pending"
        info.deleting = bool(meta.get("deletionTimestamp"))
        info.nominated = status.get("nominatedNodeName") or ""
        info.group = info.labels.get(GROUP_LABEL) or info.labels.get(GROUP_LABEL_OLD) or ""
        try:
            info.requests = pod_requests(spec)
        except ValueError as exc:
            info.requests = {"pods": 1}
            info.problem = f"unreadable resource request ({exc}); it cannot be placed"
        try:
            doc = pod_request(pod).document
        except ValueError as exc:  # the API server refuses bad quantities; a pod from elsewhere may not be
            doc = {"qos": "shared_cores"}
            info.problem = info.problem or f"unreadable resource request ({exc}); it cannot be placed"
        level = doc["qos"]
        info.kind = {"dedicated_cores": "dedicated", "reclaimed_cores": "reclaimed",
                     "system_cores": "system"}.get(level, "shared")
        info.numa_bound = bool(doc.get("numa_binding") or doc.get("numa_exclusive"))
        info.tier = doc.get("tier", "high") if info.kind == "reclaimed" else ""
        info.rank = (0, TIER_RANK.get(info.tier, 2), info.priority) if info.kind == "reclaimed" \
            else (1, 0, info.priority)
        affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or {}
        info.node_selector = tuple(sorted((spec.get("nodeSelector") or {}).items()))
        info.affinity = json.dumps(affinity.get("nodeSelectorTerms") or [], sort_keys=True) \
            if affinity.get("nodeSelectorTerms") else ""
        info.tolerations = json.dumps(spec.get("tolerations") or [], sort_keys=True) \
            if spec.get("tolerations") else ""
        info.template = (info.namespace if info.group else "", info.group, info.priority, info.kind,
                         info.numa_bound, tuple(sorted(info.requests.items())), info.node_selector,
                         info.affinity, info.tolerations, info.problem)
        return info

    def numa_need(self) -> Tuple[int, int, int]:
        """(millicpu, memory, gpus) a NUMA-bound pod needs inside one zone."""
        return (self.requests.get("cpu", 0), self.requests.get("memory", 0),
                self.requests.get("nvidia.com/gpu", 0))


def tolerations_of(text: str) -> List[Dict[str, Any]]:
    return json.loads(text) if text else []


def terms_of(text: str) -> List[Dict[str, Any]]:
    return json.loads(text) if text else []

"""NodeUsage (``tidal.io/v1alpha1``): what each pod of a node used, measured by the node's agent.

One object per node, named after it (cluster-scoped), written by the node's agent by server-side apply
every ``--pod-usage-period`` seconds and read by ``tidal cluster metrics``, which serves it as the
resource metrics API (``metrics.k8s.io``: what the HorizontalPodAutoscaler and ``kubectl top`` read)
in place of metrics-server. ``usage``:

| field | meaning |
|---|---|
| ``timestamp`` | RFC 3339, when the figures were read (the end of their window) |
| ``windowSeconds`` | the time they are averaged over (cpu: counters read at both ends) |
| ``node`` | ``{cpu, memory}`` of the whole node |
| ``pods`` | ``[{namespace, name, uid, containers: [{name, cpu, memory}]}]`` |

``cpu`` is millicpu (an integer), ``memory`` bytes: the working set, as the kubelet's summary counts
it (in use less the inactive page cache). A pod or container with no figure yet (its first window)
is left out rather than shown as 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence, Tuple

GROUP, VERSION, PLURAL, KIND = "tidal.io", "v1alpha1", "nodeusages", "NodeUsage"
MAX_MILLICPU = 1 << 40  # far beyond any node: a larger figure is a corrupt report
MAX_BYTES = 1 << 60


@dataclass(frozen=True)
class ContainerUsage:
    name: str
    millicpu: int
    memory_bytes: int


@dataclass(frozen=True)
class PodUsage:
    namespace: str
    name: str
    uid: str
    containers: Tuple[ContainerUsage, ...]


@dataclass(frozen=True)
class NodeUsage:
    node: str
    timestamp: datetime
    window_s: float
    millicpu: int
    memory_bytes: int
    pods: Tuple[PodUsage, ...]


def rfc3339(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def document(node: str, when: datetime, window_s: float, millicpu: int, memory_bytes: int,
             pods: Sequence[PodUsage]) -> Dict[str, Any]:
    """The object the agent applies."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": node},
            "usage": {"timestamp": rfc3339(when), "windowSeconds": round(float(window_s), 3),
                      "node": {"cpu": int(millicpu), "memory": int(memory_bytes)},
                      "pods": [{"namespace": p.namespace, "name": p.name, "uid": p.uid,
                                "containers": [{"name": c.name, "cpu": int(c.millicpu), "memory": int(c.memory_bytes)}
                                               for c in p.containers]} for p in pods]}}


def _amount(value: Any, where: str, top: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"{where}: {value!r} is not a whole number from 0 to {top}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 253:
        raise ValueError(f"{where}: {value!r} is not a name")
    return value


def parse(obj: Dict[str, Any]) -> NodeUsage:
    """A NodeUsage object as read from the API server; ``ValueError`` (one line, the field named) when
    it is not one (an object another writer made, an older agent's, a corrupt one)."""
    if not isinstance(obj, dict):
        raise ValueError("not an object")
    node = _text((obj.get("metadata") or {}).get("name"), "metadata.name")
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        raise ValueError(f"{node}: usage: missing")
    try:
        when = datetime.strptime(str(usage.get("timestamp")), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise ValueError(f"{node}: usage.timestamp: {usage.get('timestamp')!r} is not RFC 3339 with "
                         f"microseconds") from None
    window = usage.get("windowSeconds")
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window <= 3600:
        raise ValueError(f"{node}: usage.windowSeconds: {window!r} is not a number of seconds in (0, 3600]")
    whole = usage.get("node")
    whole = {} if whole is None else whole
    if not isinstance(whole, dict):
        raise ValueError(f"{node}: usage.node: not an object")
    pods: List[PodUsage] = []
    raw_pods = usage.get("pods")
    raw_pods = [] if raw_pods is None else raw_pods
    if not isinstance(raw_pods, list):
        raise ValueError(f"{node}: usage.pods: not a list")
    for i, pod in enumerate(raw_pods):
        at = f"{node}: usage.pods[{i}]"
        if not isinstance(pod, dict) or not isinstance(pod.get("containers"), list):
            raise ValueError(f"{at}: not a pod with a list of containers")
        containers = tuple(ContainerUsage(_text(c.get("name"), f"{at}.containers[{j}].name"),
                                          _amount(c.get("cpu"), f"{at}.containers[{j}].cpu", MAX_MILLICPU),
                                          _amount(c.get("memory"), f"{at}.containers[{j}].memory", MAX_BYTES))
                           if isinstance(c, dict) else _bad(f"{at}.containers[{j}]")
                           for j, c in enumerate(pod["containers"]))
        pods.append(PodUsage(_text(pod.get("namespace"), f"{at}.namespace"), _text(pod.get("name"), f"{at}.name"),
                             _text(pod.get("uid"), f"{at}.uid"), containers))
    return NodeUsage(node, when, float(window), _amount(whole.get("cpu", 0), f"{node}: usage.node.cpu", MAX_MILLICPU),
                     _amount(whole.get("memory", 0), f"{node}: usage.node.memory", MAX_BYTES), tuple(pods))


def _bad(where: str):
    raise ValueError(f"{where}: not an object")


def age_s(usage: NodeUsage, now: Optional[datetime] = None) -> float:
    return ((now or datetime.now(timezone.utc)) - usage.timestamp).total_seconds()

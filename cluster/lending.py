"""The lending controller: whole machines to offline while online's water level is low, and back.

Water level = cpu requested by online pods (everything but reclaimed pods)
bound to online nodes or waiting for a node / the cpu those nodes can allocate. Every period one
action, chosen by THE lending rule (``cluster.lendrule.decide``, which the
simulator runs too):

* lend: cordon the node, read its pods again (one bound to it before the
  cordon took effect is evicted too), evict its online pods through the
  Eviction API (which honours PodDisruptionBudgets: a refused eviction is
  retried next period), and once it runs no online pod, label it
  ``tidal.io/node-state=Offline``; the node's agent then moves through
  OnlineToOffline (its notice) to Offline;
* take back (above the threshold, or inside a configured online window such
  as ``18:00-23:00``): label it ``Online`` (its agent goes through
  OfflineToOnline, giving offline work its notice) and uncordon it.

``dry_run`` prints the actions and changes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from urllib.parse import quote

from contracts.errors import TidalError
from kube import timeouts
from kube.rest import list_pages
from cluster.lendrule import TAKE_BACK, OnlineNode, decide
from contracts.pods import pod_request, quantity
from contracts.states import OFFLINE, ONLINE, RECLAIMED_CPU, STATE_LABEL

log = logging.getLogger("tidal.lending")
LENDER_ANNOTATION = "tidal.io/lent-by"


class LendingError(TidalError):
    pass


def parse_window(text: str) -> Tuple[int, int]:
    """``"18:00-23:00"`` -> minutes of the day (start, end); may wrap midnight."""
    try:
        start, end = text.split("-")
        to_min = [int(h) * 60 + int(m) for h, m in (part.strip().split(":") for part in (start, end))]
    except ValueError:
        raise LendingError(f"online window {text!r}: expected HH:MM-HH:MM") from None
    if not all(0 <= v < 24 * 60 for v in to_min):
        raise LendingError(f"online window {text!r}: times must be within 00:00-23:59")
    return to_min[0], to_min[1]


def in_window(windows: List[Tuple[int, int]], epoch: float) -> bool:
    tm = time.localtime(epoch)
    minute = tm.tm_hour * 60 + tm.tm_min
    for start, end in windows:
        if (start <= minute < end) if start <= end else (minute >= start or minute < end):
            return True
    return False


@dataclass
class Level:
    requested_millicpu: int
    allocatable_millicpu: int
    online_nodes: List[str]
    lent_nodes: List[str]
    online_pods: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)
    node_allocatable: Dict[str, int] = field(default_factory=dict)
    on_lent: Dict[str, List[Dict[str, Any]]] = field(default_factory=dict)  # online pods found on lent nodes

    @property
    def value(self) -> float:
        return self.requested_millicpu / self.allocatable_millicpu if self.allocatable_millicpu else 1.0


def _is_online_pod(pod: Dict[str, Any]) -> bool:
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return False
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "DaemonSet":
            return False
    return pod_request(pod).document["qos"] != "reclaimed_cores"


def _cpu_request(pod: Dict[str, Any]) -> int:
    total = 0.0
    for container in (pod.get("spec") or {}).get("containers") or []:
        requests = ((container.get("resources") or {}).get("requests") or {})
        if RECLAIMED_CPU in requests:
            continue
        if "cpu" in requests:
            total += quantity(requests["cpu"])
    return int(total * 1000)


class LendingController:
    def __init__(self, api_client, threshold: float = 0.9, windows: Optional[List[str]] = None,
                 dry_run: bool = False, echo=print, name: str = "tidal-lending") -> None:
        from kubernetes import client

        if not 0 < threshold <= 1:
            raise LendingError(f"threshold {threshold}: must be in (0, 1]")
        from kube.rest import Rest

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        # the lists as JSON, not the client's objects: a pass over a cluster of 10,000 pods decoded them into
        # objects and back to dicts, seconds of cpu every period
        self.rest = Rest.from_config(api_client.configuration)
        self.policy = client.PolicyV1Api(api_client)
        self.threshold = threshold
        self.windows = [parse_window(w) for w in windows or []]
        self.dry_run = dry_run
        self.echo = echo
        self.name = name

    def observe(self) -> Level:
        nodes, _ = list_pages(self.rest, "/api/v1/nodes")
        pods, _ = list_pages(self.rest, "/api/v1/pods")
        online, lent, allocatable, per_node = [], [], 0, {}
        for node in nodes:
            name = node["metadata"]["name"]
            state = (node["metadata"].get("labels") or {}).get(STATE_LABEL, ONLINE)
            per_node[name] = int(quantity(((node.get("status") or {}).get("allocatable") or {}).get("cpu", "0")) * 1000)
            if state == OFFLINE:
                lent.append(name)
                continue
            online.append(name)
            allocatable += per_node[name]
        by_node: Dict[str, List[Dict[str, Any]]] = {n: [] for n in online}
        on_lent: Dict[str, List[Dict[str, Any]]] = {}
        lent_set = set(lent)
        requested = 0
        for pod in pods:
            where = (pod.get("spec") or {}).get("nodeName")
            if where in by_node and _is_online_pod(pod):
                by_node[where].append(pod)
                requested += _cpu_request(pod)
            elif not where and _is_online_pod(pod) and not (pod.get("metadata") or {}).get("deletionTimestamp"):
                # waiting for a node: its request is online's too (a Deployment scaling up, a lent node's pods
                # on their way to the others); left out, a compressed day's first pass lent a node at 16%
                # and took it back at 93% the next
                requested += _cpu_request(pod)
            elif where in lent_set and _is_online_pod(pod) and not (pod.get("metadata") or {}).get("deletionTimestamp"):
                on_lent.setdefault(where, []).append(pod)
        return Level(requested, allocatable, sorted(online), sorted(lent), by_node, per_node, on_lent)

    def step(self, now: Optional[float] = None) -> List[str]:
        """One period: returns the actions taken (or, dry, that would be)."""
        now = time.time() if now is None else now
        level = self.observe()
        actions: List[str] = []
        must_be_online = in_window(self.windows, now)
        online = [OnlineNode(n, level.node_allocatable[n], len(level.online_pods[n])) for n in level.online_nodes]
        lent = [(n, level.node_allocatable.get(n, 0)) for n in level.lent_nodes]
        decided = decide(level.requested_millicpu, online, lent, self.threshold, must_be_online)
        taken_back = {a.node for a in decided if a.kind == TAKE_BACK}
        for node, pods in sorted(level.on_lent.items()):
            if node in taken_back:
                continue
            # bound there as the node was cordoned (the scheduler's cache a moment behind): evicted now,
            # as its lending evicted the others
            actions.append(f"{node} is lent: evict {len(pods)} online pod(s) bound to it")
            if not self.dry_run:
                for pod in pods:
                    self._evict(pod)
        for action in (a for a in decided if a.kind == TAKE_BACK):
            actions.append(f"take back {action.node} (water level {action.level:.0%}"
                           + (", online window" if must_be_online else "") + ")")
            if not self.dry_run:
                self._label(action.node, ONLINE, unschedulable=False)
        if not decided or decided[0].kind == TAKE_BACK:
            return self._say(actions)
        action = decided[0]
        node = action.node
        pods = level.online_pods[node]
        actions.append(f"lend {node}: cordon, evict {len(pods)} online pod(s), then label Offline "
                       f"(water level {action.level:.0%}, {action.level_without:.0%} without it)")
        if not self.dry_run:
            self._cordon(node)
            # the node's pods read again once it is cordoned: a pod the scheduler bound to it after this
            # period's list (before the cordon) is evicted too, and none can be bound to it from here on
            # (a compressed day on a real control plane left 3 replicas on lent nodes before this)
            pods = self._online_pods_on(node)
            left = [p for p in pods if not self._evict(p)]
            if not left:
                self._label(node, OFFLINE, unschedulable=True)
            else:
                actions.append(f"{node}: {len(left)} pod(s) not evicted yet (disruption budget); retrying")
        return self._say(actions)

    def _online_pods_on(self, node: str) -> List[Dict[str, Any]]:
        found, _ = list_pages(self.rest, f"/api/v1/pods?fieldSelector={quote('spec.nodeName=' + node)}")
        return [p for p in found if _is_online_pod(p)]

    def _say(self, actions: List[str]) -> List[str]:
        for action in actions:
            self.echo(("dry run: " if self.dry_run else "") + action)
        return actions

    def _cordon(self, node: str) -> None:
        self.core.patch_node(node, {"spec": {"unschedulable": True},
                                    "metadata": {"annotations": {LENDER_ANNOTATION: self.name}}},
                             _request_timeout=timeouts.CALL)

    def _label(self, node: str, state: str, unschedulable: bool) -> None:
        self.core.patch_node(node, {"metadata": {"labels": {STATE_LABEL: state}},
                                    "spec": {"unschedulable": unschedulable}}, _request_timeout=timeouts.CALL)

    def _evict(self, pod: Dict[str, Any]) -> bool:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        meta = pod["metadata"]
        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=meta["name"], namespace=meta["namespace"]))
        try:
            self.core.create_namespaced_pod_eviction(meta["name"], meta["namespace"], body, _request_timeout=timeouts.CALL)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return True
            if exc.status == 429:  # a PodDisruptionBudget says not now
                return False
            raise

"""The cluster-wide policy: ``TidalPolicy`` objects (``tidal.io/v1alpha1``, cluster-scoped,
deploy/crd-tidalpolicy.yaml), watched by every node agent and applied without a restart.

A policy says which nodes it is for (``spec.nodeSelector``, a Kubernetes label selector; none: every
node) and the settings they get (``spec.agent``: the tunables of ``agent.tunables``, by their camelCase
field). A node follows *one* policy: of those whose selector matches its labels, the highest
``spec.priority`` (default 0), then the first by name; settings are not merged across policies, so what
a node runs is always one object's generation, which ``tidal status``, the NRT report
(``tidal.io/cluster-policy``) and the metrics name. A setting given on the node itself (a flag, the
config file) is kept over the policy's (``agent.tunables.resolve``). When no policy matches any more,
the node goes back to its own settings.

The policies are list-watched (``kube.rest.list_watch_raw``): a change reaches the agent as the API
server's event, and is applied at once; so are the node's labels (``KubeNodeAgent`` watches its Node),
so a relabelled node changes policy as the event arrives. Without the CRD installed the watch looks again
every 10 s, quietly, and the node keeps its own settings.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from kube.rest import list_watch_raw

log = logging.getLogger("tidal.k8s")
GROUP, VERSION, PLURAL, KIND = "tidal.io", "v1alpha1", "tidalpolicies", "TidalPolicy"


def selects(selector: Any, labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (``matchLabels``, ``matchExpressions`` with In, NotIn, Exists,
    DoesNotExist) against ``labels``; an empty or missing selector selects every node, one that is not
    a selector selects none."""
    if selector is None:
        return True
    if not isinstance(selector, Mapping):
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        if not isinstance(expr, Mapping):
            return False
        key, op, values = expr.get("key"), expr.get("operator"), list(expr.get("values") or [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def choose(policies: Iterable[Mapping[str, Any]], labels: Mapping[str, str]) -> Optional[Mapping[str, Any]]:
    """The policy a node with ``labels`` follows: matching, highest priority, then first by name."""
    matching: List[Tuple[int, str, Mapping[str, Any]]] = []
    for obj in policies:
        spec = obj.get("spec") or {}
        if not isinstance(spec, Mapping) or not selects(spec.get("nodeSelector"), labels):
            continue
        priority = spec.get("priority", 0)
        priority = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
        matching.append((-priority, (obj.get("metadata") or {}).get("name", ""), obj))
    return min(matching, key=lambda m: m[:2])[2] if matching else None


class PolicyWatcher:
    def __init__(self, agent, rest, stop: threading.Event, resync: float = 60.0) -> None:
        """``rest``: the API server (``kube.rest.Rest``); ``resync``: seconds a watch runs before it is renewed."""
        self.agent = agent
        self.rest = rest
        self.stop = stop
        self.resync = resync
        self.objects: Dict[str, Dict[str, Any]] = {}
        self.labels: Optional[Dict[str, str]] = None  # the node's, once read
        self.applied: Optional[Tuple[str, Any]] = None  # (name, generation) in force; None: the node's own
        self.lock = threading.Lock()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._watch, name="k8s-policies", daemon=True)
        thread.start()
        return thread

    def _watch(self) -> None:
        list_watch_raw(self.rest, f"/apis/{GROUP}/{VERSION}/{PLURAL}", self._on_list, self._on_event, self.stop,
                       f"cluster policies ({PLURAL}.{GROUP})", timeout_seconds=max(1, int(self.resync)))

    def _on_list(self, items: List[Dict[str, Any]]) -> None:
        with self.lock:
            self.objects = {(o.get("metadata") or {}).get("name", ""): o for o in items}
        self.reselect()

    def _on_event(self, kind: str, obj: Dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        with self.lock:
            if kind == "DELETED":
                self.objects.pop(name, None)
            else:
                self.objects[name] = obj
        self.reselect()

    def node_labels(self, labels: Mapping[str, str]) -> None:
        """The node's labels as just read: a change may change the policy it follows."""
        labels = dict(labels or {})
        with self.lock:
            if labels == self.labels:
                return
            self.labels = labels
        self.reselect()

    def reselect(self) -> None:
        """Apply the policy this node follows now, if it is not the one (and generation) in force. Decided
        and applied under one lock, so two events never apply out of order (the agent's lock is taken
        inside it, never the other way round)."""
        with self.lock:
            if self.labels is None:
                return  # not yet known which node this is like
            chosen = choose(self.objects.values(), self.labels)
            meta = (chosen or {}).get("metadata") or {}
            key = None if chosen is None else (meta.get("name"), meta.get("generation"))
            if key == self.applied:
                return
            doc = None if chosen is None else {"name": meta.get("name"), "generation": meta.get("generation"),
                                               "agent": (chosen.get("spec") or {}).get("agent") or {}}
            changed = self.agent.apply_policy(doc)
            self.applied = key
        log.info("cluster policy: %s%s", f"{key[0]} (generation {key[1]})" if key else "none (the node's own settings)",
                 f"; changed {', '.join(sorted(changed))}" if changed else "")

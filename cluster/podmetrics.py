"""``tidal cluster metrics``: the resource metrics API served from what Tidal's agents measured.

Each node's agent writes a NodeUsage object every ``--pod-usage-period`` (``contracts.nodeusage``: each
pod's containers' cpu over the window since its last report, and their working set); this server
list-watches those objects and the pods (for their labels and uids) and serves them as
``metrics.k8s.io/v1beta1``, the API the HorizontalPodAutoscaler and ``kubectl top`` read, in place of
metrics-server (which scrapes every kubelet for the same figures). A cluster runs one of the two: both
claim the ``v1beta1.metrics.k8s.io`` APIService.

What is served:

* a pod's figures only while the pod the report names still exists with the report's uid (a pod deleted
  and made again under its name is not shown the old one's use), and only from a report younger than
  ``stale_after`` (an agent that stopped reporting: the HPA sees the pod's metric missing, as it does when
  a kubelet is down, rather than its last figure forever);
* ``timestamp`` and ``window`` as the agent measured them: the HPA ignores a new pod's cpu until a whole
  window has passed since it became Ready, as it does with metrics-server's;
* nodes: each node's own figures (``kubectl top node``); a label selector on nodes is refused (400): the
  server does not watch nodes.

Who may call: the API server's aggregation layer, which authenticates and authorizes the user (RBAC on
``pods.metrics.k8s.io``) before it forwards, and proves itself with its front-proxy client certificate.
``client_ca`` (read from the ``kube-system/extension-apiserver-authentication`` ConfigMap, the
``requestheader-client-ca-file`` the API server publishes) makes that certificate required, and
``requestheader-allowed-names`` its common name: a caller that reaches the port with another CA's
certificate has its handshake refused, one without a certificate or with another name a 401 (the health
paths, which the kubelet probes without one, excepted).
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from cluster.metricsapi import ResourceMetricsAPI, matches
from contracts import nodeusage

log = logging.getLogger("tidal.metrics")
AUTH_CONFIGMAP = ("kube-system", "extension-apiserver-authentication")


def _window(seconds: float) -> str:
    return f"{int(round(seconds * 1000))}ms"


def _cpu(millicpu: int) -> str:
    return f"{millicpu}m"


def _memory(count: int) -> str:
    return f"{count // 1024}Ki"


class TidalMetrics(ResourceMetricsAPI):
    """The figures the agents reported (``on_usage*``) and the pods that exist (``on_pod*``), served."""

    def __init__(self, stale_after: float = 60.0,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        super().__init__()
        self.stale_after = stale_after
        self.clock = clock
        self._lock = threading.Lock()
        self._usage: Dict[str, nodeusage.NodeUsage] = {}  # node -> its last report
        # node -> namespace -> its pods there: an HPA asks for one namespace, never scanning every pod
        self._by_namespace: Dict[str, Dict[str, List[nodeusage.PodUsage]]] = {}
        self._pods: Dict[Tuple[str, str], Tuple[str, Dict[str, str]]] = {}  # (namespace, name) -> (uid, labels)
        self.refused: Dict[str, str] = {}  # node -> why its object is not read (logged once)

    # the watches ----------------------------------------------------------------------------
    def on_usage_list(self, objects: Sequence[Dict[str, Any]]) -> None:
        with self._lock:
            self._usage, self._by_namespace = {}, {}
        for obj in objects:
            self.on_usage("ADDED", obj)

    def on_usage(self, kind: str, obj: Dict[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name"))
        if kind == "DELETED":
            with self._lock:
                self._usage.pop(name, None)
                self._by_namespace.pop(name, None)
            return
        try:
            usage = nodeusage.parse(obj)
        except ValueError as exc:
            if self.refused.get(name) != str(exc):
                log.warning("NodeUsage %s is not read: %s", name, exc)
            self.refused[name] = str(exc)
            with self._lock:
                self._usage.pop(name, None)
                self._by_namespace.pop(name, None)
            return
        self.refused.pop(name, None)
        by_namespace: Dict[str, List[nodeusage.PodUsage]] = {}
        for pod in usage.pods:
            by_namespace.setdefault(pod.namespace, []).append(pod)
        with self._lock:
            self._usage[name] = usage
            self._by_namespace[name] = by_namespace

    def on_pod_list(self, pods: Sequence[Dict[str, Any]]) -> None:
        with self._lock:
            self._pods = {}
        for pod in pods:
            self.on_pod("ADDED", pod)

    def on_pod(self, kind: str, pod: Dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace") or "default", meta.get("name") or "")
        with self._lock:
            if kind == "DELETED":
                if self._pods.get(key, ("",))[0] == meta.get("uid"):
                    del self._pods[key]
            else:
                self._pods[key] = (meta.get("uid") or "", dict(meta.get("labels") or {}))

    # the answers ---------------------------------------------------------------------------
    def _fresh(self) -> List[nodeusage.NodeUsage]:
        now = self.clock()
        with self._lock:
            return [u for u in self._usage.values() if nodeusage.age_s(u, now) <= self.stale_after]

    def pod_items(self, namespace: Optional[str], selector: Dict[str, str],
                  name: Optional[str] = None) -> List[Dict[str, Any]]:
        items = []
        for usage in self._fresh():
            with self._lock:
                pods = usage.pods if namespace is None else \
                    self._by_namespace.get(usage.node, {}).get(namespace, ())
            for pod in pods:
                if name is not None and pod.name != name:
                    continue
                with self._lock:
                    uid, labels = self._pods.get((pod.namespace, pod.name), ("", {}))
                if uid != pod.uid or not matches(labels, selector):
                    continue
                items.append({"metadata": {"name": pod.name, "namespace": pod.namespace, "labels": labels,
                                           "creationTimestamp": nodeusage.rfc3339(self.clock())},
                              "timestamp": nodeusage.rfc3339(usage.timestamp), "window": _window(usage.window_s),
                              "containers": [{"name": c.name, "usage": {"cpu": _cpu(c.millicpu),
                                                                         "memory": _memory(c.memory_bytes)}}
                                             for c in pod.containers]})
        return sorted(items, key=lambda i: (i["metadata"]["namespace"], i["metadata"]["name"]))

    def node_items(self, selector: Dict[str, str], name: Optional[str] = None) -> List[Dict[str, Any]]:
        if selector:
            raise ValueError("a label selector on nodes is not served (the server does not watch nodes)")
        return [{"metadata": {"name": u.node, "creationTimestamp": nodeusage.rfc3339(self.clock())},
                 "timestamp": nodeusage.rfc3339(u.timestamp), "window": _window(u.window_s),
                 "usage": {"cpu": _cpu(u.millicpu), "memory": _memory(u.memory_bytes)}}
                for u in sorted(self._fresh(), key=lambda u: u.node) if name is None or u.node == name]

    # running -------------------------------------------------------------------------------
    def watch(self, rest, stop: threading.Event, resync: int = 300) -> List[threading.Thread]:
        """The two list-watches (NodeUsage objects, pods), each in a thread, over raw JSON (``kube.rest``: the
        client's model objects cost several times the cpu and memory for the few fields kept here)."""
        from kube.rest import list_watch_raw

        threads = [
            threading.Thread(target=list_watch_raw, name="metrics-usage", daemon=True, args=(
                rest, f"/apis/{nodeusage.GROUP}/{nodeusage.VERSION}/{nodeusage.PLURAL}", self.on_usage_list,
                self.on_usage, stop, "NodeUsage watch"), kwargs={"timeout_seconds": resync}),
            threading.Thread(target=list_watch_raw, name="metrics-pods", daemon=True, args=(
                rest, "/api/v1/pods", self.on_pod_list, self.on_pod, stop, "pod watch"),
                kwargs={"timeout_seconds": resync})]
        for thread in threads:
            thread.start()
        return threads


def front_proxy(rest) -> Tuple[Optional[str], List[str]]:
    """(the front-proxy client CA as PEM, the allowed common names) the API server publishes in
    ``kube-system/extension-apiserver-authentication``; (None, []) when it publishes none (an API server
    without ``--requestheader-client-ca-file``). ``rest``: ``kube.rest.Rest``."""
    config = rest.json("GET", f"/api/v1/namespaces/{AUTH_CONFIGMAP[0]}/configmaps/{AUTH_CONFIGMAP[1]}") or {}
    data = config.get("data") or {}
    ca = data.get("requestheader-client-ca-file") or None
    try:
        names = json.loads(data.get("requestheader-allowed-names") or "[]")
    except ValueError:
        names = []
    return ca, [str(n) for n in names if n] if isinstance(names, list) else []


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The server's HTTPS, its certificate loaded (read before anything else: a wrong file is one line at
    start); ``require_front_proxy`` adds the client CA."""
    from contracts.errors import TidalError

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TidalError(f"metrics TLS: --tls-cert {cert} / --tls-key {key}: {exc.strerror or exc}") from None
    return context


def require_front_proxy(context: ssl.SSLContext, client_ca_pem: str) -> None:
    """A client certificate, where one is given, verified against ``client_ca_pem`` (one that is not signed by
    it fails the handshake). A caller without one is let through the handshake, for the kubelet's probes of
    ``/readyz``; ``name_check`` refuses it everything else."""
    from contracts.errors import TidalError

    try:
        context.load_verify_locations(cadata=client_ca_pem)
    except (ValueError, ssl.SSLError) as exc:
        raise TidalError(f"metrics TLS: the front proxy's CA is not a PEM certificate: {exc}") from None
    context.verify_mode = ssl.CERT_OPTIONAL


def name_check(allowed: Sequence[str]) -> Callable[[Optional[Dict[str, Any]]], Optional[str]]:
    """Why a caller is refused: no client certificate (a given one was verified in the handshake), or
    its common name not among ``allowed`` (empty: any name the CA signed, as the API server's own rule)."""
    def check(cert: Optional[Dict[str, Any]]) -> Optional[str]:
        if not cert:
            return "a client certificate of the API server's front proxy is required"
        if not allowed:
            return None
        names = [value for rdn in (cert or {}).get("subject", ()) for key, value in rdn if key == "commonName"]
        if not any(n in allowed for n in names):
            return f"client certificate {names or 'none'} is not the API server's front proxy ({', '.join(allowed)})"
        return None
    return check

"""The agent on a Kubernetes node: pods in, cgroups and reports out.

* Pod source: the pods bound to this node (``spec.nodeName``), listed then
  watched from the list's resourceVersion, the watch renewed from the last
  version it saw; a relist after any error (the API server may go away: the
  agent keeps enforcing its last state and catches up when it comes back). A pod is admitted once
  (``pods.pod_request``), released when it ends or is deleted. A pod that
  cannot be admitted, or whose annotations are malformed, gets an event.
* Liveness: a pod's allocation is released when the API server says the pod
  was deleted or finished, never because a Tidal cgroup is empty (the agent
  admits it with source ``kubernetes``). A restarted agent adopts the pods'
  allocations from its checkpoint, and releases only those no listed pod
  claims, after its first full list.
* Cgroups: none written here. Each pod's processes live in the kubelet's
  cgroups (``KubeletLayout``); the node agent tells the agent where
  (``Agent.place``) and the agent's one Reconciler writes the pod's
  assignment there, as it does for every workload.
* Reports: a NodeResourceTopology by server-side apply, and the reclaimed
  capacity as extended resources in the node's status, on change and every
  ``resync``.
* Lending: the node's label ``tidal.io/node-state`` (set by the cluster's
  lending controller) says Online or Offline; the agent moves through its
  state machine to follow it, and annotates the state it is in. The node
  object is watched (a field selector on its name), not read: an agent that
  read its Node every report period made every node of a cluster one read
  of etcd a second (5,000 nodes, 5,000 reads a second).

Every call goes through ``kube.rest`` (the lean client): in its pod the agent never imports the
official client (about 30 MiB of the agent's memory).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import quote

from agent.errors import TidalError
from contracts.pods import PodRequest, legacy_workload_name, pod_request
from contracts.states import CURRENT_ANNOTATION, RECLAIMED_CPU, RECLAIMED_MEMORY, STATE_LABEL
from agent.qrm.model import KUBERNETES
from kube.crd import check_crd
from kube.rest import ApiError, Rest, list_watch_raw
from agent.reporter.nrt import build_nrt
from contracts.nrt import GROUP, PLURAL, VERSION, attribute, counted_by_the_plugin

log = logging.getLogger("tidal.k8s")
FIELD_MANAGER = "tidal-agent"
USAGE_RETRY_S = 300.0
NRT_PATH = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
APPLY = "application/apply-patch+yaml"  # server-side apply (a JSON body is YAML)
MERGE = "application/strategic-merge-patch+json"


class KubeError(TidalError):
    """The Kubernetes side is missing something the agent needs (a CRD, the node)."""


class KubeletLayout:
    """Where the kubelet puts a pod's processes: the pod's cgroup, then its containers'.

    ``driver``: ``cgroupfs`` (``kubepods/burstable/pod<uid>/<id>``) or ``systemd``
    (``kubepods.slice/...-pod<uid_>.slice/<runtime>-<id>.scope``), detected from
    which of ``kubepods`` / ``kubepods.slice`` exists unless given. Only paths:
    the agent's Reconciler writes them (``Agent.place``), once the kubelet made them.
    """

    def __init__(self, cgroups, driver: Optional[str] = None) -> None:
        self.driver = driver or self.detect(cgroups)

    @staticmethod
    def detect(cgroups) -> str:
        present = getattr(cgroups, "present", cgroups.exists)
        return "systemd" if present("kubepods.slice") else "cgroupfs"

    def paths(self, pod: Dict[str, Any], request: PodRequest) -> Tuple[str, ...]:
        from agent.isolation.cgroups.layout import kubelet_container_path, kubelet_pod_path

        paths = [kubelet_pod_path(self.driver, request.qos_class, request.uid)]
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if status.get("containerID"):
                try:
                    paths.append(kubelet_container_path(self.driver, request.qos_class, request.uid,
                                                        status["containerID"]))
                except ValueError as exc:  # a runtime whose layout Tidal does not know: the pod cgroup still holds it
                    log.debug("pod %s: %s", request.workload, exc)
        return tuple(paths)

    def containers(self, pod: Dict[str, Any], request: PodRequest) -> List[Tuple[str, str]]:
        """(name, cgroup) of each of the pod's running containers (its init containers left out: the
        resource metrics API shows a pod's app containers)."""
        from agent.isolation.cgroups.layout import kubelet_container_path

        out = []
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            if status.get("containerID") and "running" in (status.get("state") or {}):
                try:
                    out.append((status.get("name") or "", kubelet_container_path(
                        self.driver, request.qos_class, request.uid, status["containerID"])))
                except ValueError:
                    pass
        return out


class KubeNodeAgent:
    def __init__(self, agent, rest: Rest, node_name: str, resync: float = 30.0, report_period: float = 1.0,
                 notice: Optional[str] = None, kubelet_driver: Optional[str] = None, topology_policy: str = "none",
                 kubelet_root: Optional[str] = None, pod_usage_period: float = 15.0) -> None:
        """``kubelet_root``: the kubelet's root directory, whose CPU manager checkpoint is read again every
        report (a kubelet restarted with the static policy beside a running agent is a conflict, shown
        in status and metrics; the agent refuses only at its own start). ``pod_usage_period``: seconds
        between NodeUsage reports (each pod's use, for ``tidal cluster metrics``); 0: none. ``rest``: the
        API server (``kube.rest.connect``); ``resync``: seconds a watch runs before the server renews it, and
        between two reports that changed nothing."""
        self.agent = agent
        self.rest = rest
        self.node = node_name
        self.node_path = f"/api/v1/nodes/{quote(node_name, safe='')}"
        self.node_doc: Optional[Dict[str, Any]] = None  # the Node as last read or watched
        self.node_watch_refused = False  # the role may not watch Nodes: read every period instead
        self._annotated: Optional[Tuple[str, str]] = None  # (state, the node's version) last annotated
        self.resync = resync
        self.report_period = report_period
        self.notice = notice
        self.layout = KubeletLayout(agent.driver, kubelet_driver)
        self.pods: Dict[str, PodRequest] = {}  # uid -> request (admitted)
        self.pod_docs: Dict[str, Dict[str, Any]] = {}
        # every pod on the node (admitted or not): uid -> (namespace, name, counted by the upstream plugin)
        self.node_pods: Dict[str, Tuple[str, str, bool]] = {}
        self.topology_policy = topology_policy
        self.kubelet_root = kubelet_root
        self.refused: Dict[str, str] = {}  # uid -> why (event recorded once)
        # the agent's own lock, not a second one: the pod watch admits (the agent's lock taken inside
        # this one) while the report loop reads the agent's state (the agent's lock, then this one);
        # two locks taken in both orders deadlocked both threads, silently
        self.lock = agent.lock
        self.stop = threading.Event()
        self.threads = []
        self.last_report: Optional[str] = None
        self.last_report_at = 0.0
        from agent.k8s.policy import PolicyWatcher

        self.policies = PolicyWatcher(agent, rest, self.stop, resync=resync)
        self.published = 0
        self.api_errors = 0
        from agent.reporter.pod_usage import PodUsageMeter

        self.pod_usage_period = pod_usage_period
        self.usage_meter = PodUsageMeter(agent.driver)
        self.usage_at = 0.0  # monotonic time of the last measure
        self.usage_reports = 0
        self.usage_off: Optional[str] = None  # why NodeUsage is not reported (its CRD missing: tried again
        # every USAGE_RETRY_S, for a CRD installed after the agent)

    # ---- start ----------------------------------------------------------------------------
    def check(self) -> None:
        check_crd(lambda: self.rest.json("GET", f"{NRT_PATH}?limit=1"), KubeError)
        try:
            node = self.rest.json("GET", self.node_path)
        except ApiError as exc:
            raise KubeError(f"node {self.node!r}: {exc.status} {' '.join(exc.message.split())[:200]}") from None
        except OSError as exc:
            raise KubeError(f"node {self.node!r}: the API server at {self.rest.host}:{self.rest.port}: {exc}") from None
        self._on_node(node)

    def start(self) -> None:
        self.check()
        for target, name in ((self._watch_pods, "pods"), (self._watch_node, "node"), (self._report_loop, "report")):
            thread = threading.Thread(target=target, name=f"k8s-{name}-{self.node}", daemon=True)
            thread.start()
            self.threads.append(thread)
        self.threads.append(self.policies.start())  # the cluster policies: applied as their events come

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=5)

    # ---- pods -----------------------------------------------------------------------------
    def _watch_pods(self) -> None:
        list_watch_raw(self.rest, f"/api/v1/pods?fieldSelector={quote('spec.nodeName=' + self.node, safe='')}",
                       self._on_pod_list, self._on_pod_event, self.stop, f"pod watch on {self.node}",
                       timeout_seconds=max(1, int(self.resync)), on_error=self._count_error)

    def _watch_node(self) -> None:
        """The node's labels (its lending state, the policy it follows) and annotations, as they change."""
        def listed(nodes) -> None:
            if self.node_watch_refused:
                log.info("node watch on %s allowed now: the Node is no longer read every period", self.node)
                self.node_watch_refused = False
            if nodes:
                self._on_node(nodes[0])

        list_watch_raw(self.rest, f"/api/v1/nodes?fieldSelector={quote('metadata.name=' + self.node, safe='')}",
                       listed, lambda kind, node: kind != "DELETED" and self._on_node(node), self.stop,
                       f"node watch on {self.node}", timeout_seconds=max(1, int(self.resync)),
                       on_error=self._node_watch_error)

    def _node_watch_error(self, exc: Exception) -> None:
        """A role without list/watch on Nodes (an agent upgraded before its RBAC): the Node is read every
        report period instead, as agents before 0.2 did, and said once."""
        self.api_errors += 1
        if isinstance(exc, ApiError) and exc.status == 403 and not self.node_watch_refused:
            log.warning("node watch on %s refused (403: the agent's role needs list and watch on nodes, "
                        "deploy/rbac.yaml); reading the Node every %.0f s instead", self.node, self.report_period)
            self.node_watch_refused = True

    def _on_node(self, node: Dict[str, Any]) -> None:
        self.node_doc = node
        self.policies.node_labels((node.get("metadata") or {}).get("labels") or {})  # a relabelled node may
        # follow another policy

    def _count_error(self, _exc: Exception) -> None:
        self.api_errors += 1

    def _on_pod_list(self, pods) -> None:
        """A full list: every pod as an event, then what no listed pod claims is released."""
        for pod in pods:
            self.on_pod(pod)
        seen = {pod["metadata"]["uid"] for pod in pods}
        with self.lock:
            for uid in [u for u in self.node_pods if u not in seen]:
                del self.node_pods[uid]
            for uid in [u for u in self.pods if u not in seen]:
                self._release(uid)
            self._release_unclaimed()

    def _on_pod_event(self, kind: str, pod: Dict[str, Any]) -> None:
        if kind == "DELETED":
            with self.lock:
                self.node_pods.pop(pod["metadata"]["uid"], None)
                self._release(pod["metadata"]["uid"])
        else:
            self.on_pod(pod)

    def on_pod(self, pod: Dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        phase = (pod.get("status") or {}).get("phase")
        events = []  # sent after the lock is let go: the lock is the agent's, an API call may take seconds
        with self.lock:
            self.node_pods[uid] = (meta.get("namespace", "default"), meta.get("name", ""), counted_by_the_plugin(pod))
            if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
                self._release(uid)
                return
            self.pod_docs[uid] = pod
            if uid in self.pods or uid in self.refused:
                if uid in self.pods:
                    self._place(uid)
                return
            request = pod_request(pod, self.topology_policy)
            held = self.agent.state.get(request.workload)
            if held is None:  # an older agent's checkpoint names the pod <namespace>.<name>: adopted
                old = self.agent.state.get(legacy_workload_name(pod))
                if old is not None and old.source == KUBERNETES:
                    log.info("pod %s: renaming workload %s to %s", request.document.get("label"), old.name,
                             request.workload)
                    self.agent.rename(old.name, request.workload, request.document.get("label"))
                    held = self.agent.state.get(request.workload)
            if held is not None and held.source == KUBERNETES:
                self.pods[uid] = request  # admitted before a restart: kept, not admitted again
                self._place(uid)
                return
            if request.problem:
                events.append(("TidalBadAnnotation", request.problem))
            try:
                self.agent.admit(request.document, source=KUBERNETES)
            except TidalError as exc:
                self.refused[uid] = str(exc)
                events.append(("TidalAdmissionFailed", str(exc)))
            else:
                self.pods[uid] = request
                self._place(uid)
        for reason, message in events:
            self._event(pod, reason, message, "Warning")

    def _place(self, uid: str) -> None:
        """Tell the agent where the pod's processes live (its containers appear as they start)."""
        request = self.pods[uid]
        if self.agent.state.get(request.workload) is None:
            return
        self.agent.place(request.workload, self.layout.paths(self.pod_docs.get(uid, {}), request))

    def _release(self, uid: str) -> None:
        self.refused.pop(uid, None)
        self.pod_docs.pop(uid, None)
        request = self.pods.pop(uid, None)
        if request is not None:
            try:
                self.agent.release(request.workload)
            except TidalError:
                pass

    def _release_unclaimed(self) -> None:
        """After a full list: pod allocations no listed pod claims (deleted while the agent
        was down or the watch was broken) are released; local workloads are not this source's."""
        claimed = {request.workload for request in self.pods.values()}
        for alloc in list(self.agent.state.allocations):
            if alloc.source == KUBERNETES and alloc.name not in claimed:
                log.info("releasing %s: no pod on %s claims it", alloc.name, self.node)
                try:
                    self.agent.release(alloc.name)
                except TidalError:
                    pass

    def _event(self, pod: Dict[str, Any], reason: str, message: str, kind: str = "Normal") -> None:
        meta = pod["metadata"]
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {"metadata": {"generateName": f"{meta['name']}.tidal-", "namespace": meta.get("namespace", "default")},
                "involvedObject": {"kind": "Pod", "name": meta["name"], "namespace": meta.get("namespace", "default"),
                                   "uid": meta["uid"], "apiVersion": "v1"},
                "reason": reason, "message": message[:1000], "type": kind, "source": {"component": "tidal-agent",
                                                                                     "host": self.node},
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}
        try:
            self.rest.json("POST", f"/api/v1/namespaces/{quote(meta.get('namespace', 'default'), safe='')}/events", body)
        except Exception as exc:  # noqa: BLE001
            log.warning("event on %s: %s", meta["name"], exc)

    # ---- reports and lending ------------------------------------------------------------------
    def _report_loop(self) -> None:
        while not self.stop.wait(self.report_period):
            self.check_kubelet()
            try:
                self.follow_node_label()
                self.publish()
                self.agent.reports["nrt"] = time.time()  # the report in the API server is the agent's now
            except Exception as exc:  # noqa: BLE001
                self.api_errors += 1
                log.warning("report from %s: %s", self.node, exc)
            since = time.monotonic() - self.usage_at
            if self.pod_usage_period > 0 and since >= (self.pod_usage_period if self.usage_off is None
                                                       else USAGE_RETRY_S):
                try:
                    self.publish_usage()
                except Exception as exc:  # noqa: BLE001
                    self.api_errors += 1
                    log.warning("usage report from %s: %s", self.node, exc)

    def lending_notice(self):
        """The notice a label-driven lending gets: the one given here, else the agent's (a policy may set it)."""
        if self.notice is not None:
            return self.notice
        return self.agent.tuned.get("lending-notice", (self.agent.config.lending_notice,))[0]

    def check_kubelet(self) -> None:
        """The kubelet's CPU manager policy now: a conflict while it is one the agent refuses beside."""
        from agent.k8s.cpumanager import kubelet_cpu_manager_policy, refusal

        if self.kubelet_root is None:
            return
        try:
            why = refusal(kubelet_cpu_manager_policy(self.kubelet_root), self.kubelet_root)
        except ValueError as exc:
            why = None
            log.debug("kubelet checkpoint: %s", exc)
        had = self.agent.conflicts.get("kubelet_cpu_manager")
        if why and why != had:
            log.error("conflict: %s", why)
        elif had and not why:
            log.warning("the kubelet's CPU manager conflict is over")
        if why:
            self.agent.conflicts["kubelet_cpu_manager"] = why
        else:
            self.agent.conflicts.pop("kubelet_cpu_manager", None)

    def nrt(self, now: Optional[float] = None) -> Dict[str, Any]:
        agent = self.agent
        with self.lock:
            cap = agent.harvest.capacity
            memory = {r.workload: r.memory for r in self.pods.values()}
            return build_nrt(self.node, agent.topology, agent.state, agent.pools(), memory,
                             cap.millicpu if cap else 0, cap.memory_bytes if cap else 0,
                             agent.lending.current.state, self.pods.keys(), now,
                             counted_pods=[(ns, name) for ns, name, counted in self.node_pods.values() if counted],
                             topology_policy=self.topology_policy,
                             cluster_policy=f"{agent.policy['name']}/{agent.policy['generation']}" if agent.policy else "none")

    def publish(self, force: bool = False) -> bool:
        body = self.nrt()
        key = json.dumps({k: v for k, v in body.items() if k != "attributes"}, sort_keys=True) + json.dumps(
            [a for a in body["attributes"] if a["name"] != "tidal.io/updated"], sort_keys=True)
        due = time.monotonic() - self.last_report_at >= self.resync
        if key == self.last_report and not due and not force:
            return False
        self.rest.json("PATCH", f"{NRT_PATH}/{quote(self.node, safe='')}?fieldManager={FIELD_MANAGER}&force=true",
                       body, content_type=APPLY)
        reclaimed = {RECLAIMED_CPU: str(attribute(body, "tidal.io/reclaimed-millicpu")),
                     RECLAIMED_MEMORY: str(attribute(body, "tidal.io/reclaimed-memory"))}
        self.rest.json("PATCH", f"{self.node_path}/status",
                       {"status": {"capacity": reclaimed, "allocatable": reclaimed}}, content_type=MERGE)
        self.last_report, self.last_report_at = key, time.monotonic()
        self.published += 1
        return True

    def usage_document(self) -> Optional[Dict[str, Any]]:
        """Each running pod's use since the last call, as a NodeUsage object (``contracts.nodeusage``);
        ``None`` the first time (a rate needs two reads)."""
        from datetime import datetime, timezone

        from contracts import nodeusage

        with self.lock:  # which pods, and where: the cgroups themselves are read after the lock is let go
            # every pod of the node that has not ended, a pod the agent refused too (the kubelet runs it)
            pods = [(ns, name, uid, self.layout.containers(doc, self.pods.get(uid) or
                                                           pod_request(doc, self.topology_policy)))
                    for uid, doc in self.pod_docs.items()
                    for ns, name, _counted in [self.node_pods.get(uid, ("", "", False))] if name]
        self.usage_at = time.monotonic()
        measured = self.usage_meter.measure(pods)
        window = self.usage_meter.window_s
        if window is None or window <= 0:
            return None
        return nodeusage.document(self.node, datetime.now(timezone.utc), min(window, 3600.0),
                                  self.usage_meter.node_millicpu, self.usage_meter.node_bytes, measured)

    def publish_usage(self) -> bool:
        """The NodeUsage report, applied; a cluster without its CRD gets one warning, and a try every
        ``USAGE_RETRY_S`` rather than every period."""
        from contracts import nodeusage

        body = self.usage_document()
        if body is None:
            return False
        try:
            self.rest.json("PATCH", f"/apis/{nodeusage.GROUP}/{nodeusage.VERSION}/{nodeusage.PLURAL}/"
                           f"{quote(self.node, safe='')}?fieldManager={FIELD_MANAGER}&force=true", body,
                           content_type=APPLY)
        except ApiError as exc:
            if exc.status == 404:  # an apply creates a missing object: 404 is the resource type missing
                why = (f"the NodeUsage CRD ({nodeusage.PLURAL}.{nodeusage.GROUP}) is not installed: no pod usage "
                       f"is reported (kubectl apply -f deploy/crd-nodeusage.yaml)")
                if self.usage_off is None:
                    log.warning("%s", why)
                self.usage_off = why
                return False
            raise
        if self.usage_off is not None:
            log.info("the NodeUsage CRD is there now: pod usage is reported")
            self.usage_off = None
        self.usage_reports += 1
        self.agent.reports["nodeusage"] = time.time()
        return True

    def follow_node_label(self) -> None:
        """Follow the lending label of the node as last watched (nothing read here), and say the state the
        agent is in by the node's annotation, written once for each state and version of the node."""
        from agent.lending import OFFLINE, ONLINE, TO_OFFLINE, TO_ONLINE

        if self.node_watch_refused:
            self._on_node(self.rest.json("GET", self.node_path))
        node = self.node_doc
        if node is None:
            return
        meta = node.get("metadata") or {}
        want = (meta.get("labels") or {}).get(STATE_LABEL)
        current = self.agent.lending.current.state
        if want == OFFLINE and current == ONLINE:
            self.agent.lend(self.lending_notice())
        elif want == ONLINE and current == OFFLINE:
            self.agent.take_back(self.lending_notice())
        elif want == ONLINE and current == TO_OFFLINE:
            self.agent.take_back("0s")  # called off during the notice
        elif want == OFFLINE and current == TO_ONLINE:
            pass  # let the take-back finish; the next period lends again
        current = self.agent.lending.current.state
        annotations = meta.get("annotations") or {}
        done = (current, meta.get("resourceVersion", ""))
        if annotations.get(CURRENT_ANNOTATION) != current and self._annotated != done:
            self.rest.json("PATCH", self.node_path, {"metadata": {"annotations": {CURRENT_ANNOTATION: current}}},
                           content_type=MERGE)
            self._annotated = done  # the watch brings the node as patched; a patch lost is made again then

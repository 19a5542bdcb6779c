"""The binder: bindings, evictions and what a scheduler tells users, on worker threads.

Each job is a unit's committed placement (``core.Placer.commit`` already
checked it against the latest state, so a gang reaches here whole or not at
all). Workers ``POST .../pods/<name>/binding`` concurrently, each on its own
keep-alive connection; the API server sets the pod's ``PodScheduled``
condition. A binding the API server refuses (the pod was deleted, or bound by
someone else: 404/409) gives the pod's room back and ends its unit's turn; any
other failure puts the pod back in line.

Writes users read but the placement does not wait for go through a second,
bounded queue: ``Scheduled`` and ``FailedScheduling`` events
(``events.k8s.io/v1``), the ``PodScheduled=False`` condition with the reason
of a pod that waits, a preemptor's ``status.nominatedNodeName``. When that
queue is full the oldest writes are dropped and counted (client-go's event
broadcaster drops in the same way); bindings are never dropped.

Evictions (preemption's victims) go through the Eviction API
(``policy/v1``), so PodDisruptionBudgets hold: a 429 is a refused victim.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from typing import Callable, List, Optional, Tuple

from kube.rest import ApiError, Rest, rfc3339_micro
from cluster.scheduler.pods import PodInfo

log = logging.getLogger("tidal.scheduler")
NOTICE_QUEUE = 20000


class Binder:
    def __init__(self, rest: Rest, name: str, workers: int = 8,
                 on_bound: Callable[[PodInfo, str, float], None] = lambda *a: None,
                 on_failed: Callable[[PodInfo, str, int, str], None] = lambda *a: None,
                 metrics=None) -> None:
        self.rest = rest
        self.name = name  # reportingController of events; the pods' schedulerName
        self.instance = f"{name}-{os.uname().nodename}-{os.getpid()}"
        self.on_bound, self.on_failed = on_bound, on_failed
        self.metrics = metrics
        self.jobs: "queue.Queue[Optional[Tuple[PodInfo, str]]]" = queue.Queue()
        self.notices: "queue.Queue[Optional[Tuple[str, str, bytes]]]" = queue.Queue(NOTICE_QUEUE)
        self.dropped = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._work, name=f"bind-{i}", daemon=True) for i in range(workers)]
        self.threads += [threading.Thread(target=self._notify, name=f"notify-{i}", daemon=True)
                         for i in range(max(1, workers // 2))]
        for thread in self.threads:
            thread.start()

    def submit(self, placements: List[Tuple[PodInfo, str]]) -> None:
        """Bind each (pod, node name), on whichever workers are free (a gang's pods at once)."""
        for item in placements:
            self.jobs.put(item)

    def busy(self) -> int:
        return self.jobs.qsize()

    def close(self) -> None:
        self.stop.set()
        for _ in self.threads:
            self.jobs.put(None)

    # ---- bindings ------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None or self.stop.is_set():
                return
            self._bind(*job)

    def _bind(self, pod: PodInfo, node: str) -> None:
        body = json.dumps({"apiVersion": "v1", "kind": "Binding",
                           "metadata": {"name": pod.name, "uid": pod.uid},
                           "target": {"apiVersion": "v1", "kind": "Node", "name": node}}).encode()
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/binding"
        try:
            status, answer = self.rest.call("POST", path, body)
        except Exception as exc:  # noqa: BLE001 - the API server away: the pod waits its turn again
            self.on_failed(pod, node, 0, str(exc))
            return
        if status in (200, 201):
            self.on_bound(pod, node, time.time())
            self.event(pod, "Normal", "Scheduled", "Binding", f"Successfully assigned {pod.key} to {node}")
            return
        message = ApiError(status, "POST", path, answer).message
        self.on_failed(pod, node, status, message)

    # ---- evictions ------------------------------------------------------------------------------------------
    def evict(self, pod: PodInfo) -> Tuple[bool, str]:
        """(evicted, why not): the Eviction API, which refuses what a PodDisruptionBudget protects (429)."""
        body = json.dumps({"apiVersion": "policy/v1", "kind": "Eviction",
                           "metadata": {"name": pod.name, "namespace": pod.namespace}}).encode()
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/eviction"
        try:
            status, answer = self.rest.call("POST", path, body)
        except Exception as exc:  # noqa: BLE001
            return False, str(exc)
        if status in (200, 201, 404):  # 404: already gone
            return True, ""
        return False, ApiError(status, "POST", path, answer).message

    # ---- what users read ----------------------------------------------------------------------------------------
    def event(self, pod: PodInfo, kind: str, reason: str, action: str, note: str) -> None:
        now = time.time()
        body = {"apiVersion": "events.k8s.io/v1", "kind": "Event",
                "metadata": {"name": f"{pod.name}.{int(now * 1e9):x}", "namespace": pod.namespace},
                "eventTime": rfc3339_micro(now), "reportingController": self.name,
                "reportingInstance": self.instance[:128], "action": action, "reason": reason, "type": kind,
                "note": note[:1024], "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace,
                                                   "name": pod.name, "uid": pod.uid}}
        self._notice("POST", f"/apis/events.k8s.io/v1/namespaces/{pod.namespace}/events", json.dumps(body).encode())

    def unschedulable(self, pod: PodInfo, message: str) -> None:
        """The PodScheduled=False condition a user sees in ``kubectl describe pod``, and its event."""
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message[:1024],
                     "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        patch = {"status": {"conditions": [condition]}}
        self._notice("PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
                     json.dumps(patch).encode(), "application/strategic-merge-patch+json")
        self.event(pod, "Warning", "FailedScheduling", "Scheduling", message)

    def nominate(self, pod: PodInfo, node: str) -> None:
        patch = {"status": {"nominatedNodeName": node or None}}
        self._notice("PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
                     json.dumps(patch).encode(), "application/strategic-merge-patch+json")

    def _notice(self, method: str, path: str, body: bytes, content_type: Optional[str] = None) -> None:
        item = (method, path, body, content_type)
        while True:
            try:
                self.notices.put_nowait(item)
                return
            except queue.Full:
                try:
                    self.notices.get_nowait()
                    self.dropped += 1
                    if self.metrics is not None:
                        self.metrics.dropped.inc()
                except queue.Empty:
                    pass

    def _notify(self) -> None:
        while not self.stop.is_set():
            try:
                item = self.notices.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            method, path, body, content_type = item
            try:
                status, answer = self.rest.call(method, path, body, content_type)
                if status >= 300 and status != 404:
                    log.debug("%s %s: %s", method, path, ApiError(status, method, path, answer))
            except Exception as exc:  # noqa: BLE001 - an event lost is not a reason to stop
                log.debug("%s %s: %s", method, path, exc)

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until the queues are empty (tests and the benchmark's end)."""
        deadline = time.monotonic() + timeout
        while (self.jobs.qsize() or self.notices.qsize()) and time.monotonic() < deadline:
            time.sleep(0.05)

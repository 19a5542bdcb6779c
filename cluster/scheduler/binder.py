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

With ``processes``, bindings and their ``Scheduled`` events are made by
worker processes (each with its threads and connections): an HTTP exchange
costs a Python interpreter about as much cpu as placing the pod did, and one
interpreter runs on one core at a time (its lock), so on a machine with cores
to spare the binder is Gödel's: a component of its own. The scheduler sends
each a batch of (pod, node) at a time and reads back what became of each.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from kube.rest import ApiError, Rest, rfc3339_micro
from cluster.scheduler.pods import PodInfo

log = logging.getLogger("tidal.scheduler")
NOTICE_QUEUE = 20000


class Binder:
    def __init__(self, rest: Rest, name: str, workers: int = 32,
                 on_bound: Callable[[PodInfo, str, float], None] = lambda *a: None,
                 on_failed: Callable[[PodInfo, str, int, str], None] = lambda *a: None,
                 metrics=None, processes: int = 0) -> None:
        self.rest = rest
        self.name = name  # reportingController of events; the pods' schedulerName
        self.instance = f"{name}-{os.uname().nodename}-{os.getpid()}"
        self.on_bound, self.on_failed = on_bound, on_failed
        self.metrics = metrics
        self.jobs: "queue.Queue[Optional[Tuple[PodInfo, str]]]" = queue.Queue()
        self.notices: "queue.Queue[Optional[Tuple[str, str, bytes]]]" = queue.Queue(NOTICE_QUEUE)
        self.dropped = 0
        self.stop = threading.Event()
        self.processes: List[multiprocessing.Process] = []
        self._waiting: Dict[str, PodInfo] = {}  # uid -> pod, while a worker process binds it
        self._next = 0
        if processes:
            context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
            self._results = context.Queue()
            self._inboxes = []
            per = max(1, workers // processes)
            for i in range(processes):
                inbox = context.Queue()
                proc = context.Process(target=_bind_process, name=f"tidal-binder-{i}", daemon=True,
                                       args=(rest.spec(), name, self.instance, per, inbox, self._results))
                proc.start()
                self.processes.append(proc)
                self._inboxes.append(inbox)
            self.threads = [threading.Thread(target=self._collect, name="bind-results", daemon=True)]
        else:
            self.threads = [threading.Thread(target=self._work, name=f"bind-{i}", daemon=True) for i in range(workers)]
        self.threads += [threading.Thread(target=self._notify, name=f"notify-{i}", daemon=True)
                         for i in range(2 if processes else max(1, min(8, workers // 2)))]
        for thread in self.threads:
            thread.start()

    def submit(self, placements: List[Tuple[PodInfo, str]]) -> None:
        """Bind each (pod, node name), on whichever workers are free (a gang's pods at once)."""
        if not placements:
            return
        if not self.processes:
            for item in placements:
                self.jobs.put(item)
            return
        batch = []
        for pod, node in placements:
            self._waiting[pod.uid] = pod
            batch.append((pod.namespace, pod.name, pod.uid, node))
        # the batch to the worker processes in turn, split so a large one keeps every process busy
        share = max(1, -(-len(batch) // len(self._inboxes)))
        for start in range(0, len(batch), share):
            self._inboxes[self._next % len(self._inboxes)].put(batch[start:start + share])
            self._next += 1

    def busy(self) -> int:
        return self.jobs.qsize() + len(self._waiting)

    def close(self) -> None:
        self.stop.set()
        for _ in self.threads:
            self.jobs.put(None)
        for inbox in getattr(self, "_inboxes", []):
            inbox.put(None)
        for proc in self.processes:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()

    # ---- bindings ------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None or self.stop.is_set():
                return
            self._bind(*job)

    def _bind(self, pod: PodInfo, node: str) -> None:
        status, message = bind(self.rest, pod.namespace, pod.name, pod.uid, node)
        if status in (200, 201):
            self.on_bound(pod, node, time.time())
            self.event(pod, "Normal", "Scheduled", "Binding", f"Successfully assigned {pod.key} to {node}")
        else:
            self.on_failed(pod, node, status, message)

    def _collect(self) -> None:
        """What the worker processes say of each binding, to the scheduler."""
        while not self.stop.is_set():
            try:
                results = self._results.get(timeout=0.5)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            for uid, node, status, message, when in results:
                pod = self._waiting.pop(uid, None)
                if pod is None:
                    continue
                if status in (200, 201):
                    self.on_bound(pod, node, when)
                else:
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
        while (self.jobs.qsize() or self.notices.qsize() or self._waiting) and time.monotonic() < deadline:
            time.sleep(0.05)


def bind(rest: Rest, namespace: str, name: str, uid: str, node: str) -> Tuple[int, str]:
    """POST the pod's Binding: (status, the server's message); status 0 when the server was not reached."""
    body = json.dumps({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "uid": uid},
                       "target": {"apiVersion": "v1", "kind": "Node", "name": node}}).encode()
    path = f"/api/v1/namespaces/{namespace}/pods/{name}/binding"
    try:
        status, answer = rest.call("POST", path, body)
    except Exception as exc:  # noqa: BLE001 - the API server away: the pod waits its turn again
        return 0, str(exc)
    return status, "" if status in (200, 201) else ApiError(status, "POST", path, answer).message


def scheduled_event(name: str, instance: str, namespace: str, pod: str, uid: str, node: str) -> bytes:
    now = time.time()
    return json.dumps({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": f"{pod}.{int(now * 1e9):x}", "namespace": namespace},
        "eventTime": rfc3339_micro(now), "reportingController": name, "reportingInstance": instance[:128],
        "action": "Binding", "reason": "Scheduled", "type": "Normal",
        "note": f"Successfully assigned {namespace}/{pod} to {node}",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod, "uid": uid}}).encode()


def _bind_process(spec: dict, name: str, instance: str, threads: int, inbox, results) -> None:
    """A worker process: bind what arrives in ``inbox`` on ``threads`` threads, write each pod's Scheduled
    event, and say in ``results`` what became of each: (uid, node, status, message, when)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler stops it, not the terminal's ^C
    rest = Rest.from_spec(spec)
    work: "queue.Queue" = queue.Queue()
    done: "queue.Queue" = queue.Queue()

    def worker() -> None:
        while True:
            job = work.get()
            if job is None:
                return
            namespace, pod, uid, node = job
            status, message = bind(rest, namespace, pod, uid, node)
            done.put((uid, node, status, message, time.time()))
            if status in (200, 201):
                try:
                    rest.call("POST", f"/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                              scheduled_event(name, instance, namespace, pod, uid, node))
                except Exception:  # noqa: BLE001 - an event lost is not a reason to stop
                    pass

    def report() -> None:  # results in batches: one pickle for many pods
        while True:
            batch = [done.get()]
            while True:
                try:
                    batch.append(done.get_nowait())
                except queue.Empty:
                    break
            results.put(batch)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    pool.append(threading.Thread(target=report, daemon=True))
    for thread in pool:
        thread.start()
    while True:
        batch = inbox.get()
        if batch is None:
            return
        for job in batch:
            work.put(job)

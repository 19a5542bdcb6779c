"""Leader election on a Lease (``coordination.k8s.io/v1``), so two replicas never both schedule.

The rules of client-go's leader election, on the lease's own fields:

1. A candidate reads the Lease. None: it creates one naming itself (a
   conflict means another was faster: read again).
2. Held by another: the candidate waits until it has seen the same
   ``renewTime`` unchanged for ``leaseDurationSeconds`` of its own clock
   (clocks of different machines are never compared), then takes the Lease
   with an update on the ``resourceVersion`` it read: of two candidates only
   one update succeeds.
3. The leader renews every ``retry`` seconds with the same optimistic update.
   If it has not renewed for ``renew_deadline`` seconds it has lost the lease
   and must stop scheduling at once (``on_lost``): by then another replica
   may hold it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from kube.rest import ApiError, Rest, rfc3339_micro

log = logging.getLogger("tidal.scheduler")


class LeaderElector:
    def __init__(self, rest: Rest, namespace: str, name: str, identity: Optional[str] = None,
                 lease_duration: float = 15.0, renew_deadline: float = 10.0, retry: float = 2.0) -> None:
        if not 0 < retry < renew_deadline < lease_duration:
            raise ValueError("leader election needs retry < renew deadline < lease duration")
        self.rest, self.namespace, self.name = rest, namespace, name
        self.identity = identity or f"{os.uname().nodename}_{os.getpid()}"
        self.duration, self.deadline, self.retry = lease_duration, renew_deadline, retry
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.leading = threading.Event()
        self._observed: Optional[tuple] = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._renewed_at = 0.0

    def _body(self, lease: Optional[dict], transitions: int) -> dict:
        now = rfc3339_micro()
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration),
                "acquireTime": now, "renewTime": now, "leaseTransitions": transitions}
        if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
            spec["acquireTime"] = lease["spec"].get("acquireTime") or now
        meta = {"name": self.name, "namespace": self.namespace}
        if lease is not None:
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def try_acquire_or_renew(self) -> bool:
        try:
            lease = self.rest.json("GET", self.path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            try:
                self.rest.json("POST", f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases",
                               self._body(None, 0))
                return True
            except ApiError as again:
                if again.status == 409:
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        seen = (holder, spec.get("renewTime"))
        now = time.monotonic()
        if seen != self._observed:
            self._observed, self._observed_at = seen, now
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder and holder != self.identity:
            if now - self._observed_at < float(spec.get("leaseDurationSeconds") or self.duration):
                return False  # held, and renewed within its duration as far as this clock can tell
            transitions += 1
        try:
            self.rest.json("PUT", self.path, self._body(lease, transitions))
            return True
        except ApiError as exc:
            if exc.status == 409:  # someone else updated it first
                return False
            raise

    def run(self, stop: threading.Event, on_started: Callable[[], None], on_lost: Callable[[], None]) -> None:
        """Block until leading, call ``on_started``, renew until ``stop``; ``on_lost`` if renewal fails."""
        while not stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    break
            except Exception as exc:  # noqa: BLE001 - the API server away: keep trying
                log.warning("leader election: %s", exc)
            stop.wait(self.retry)
        if stop.is_set():
            return
        log.info("leader election: %s leads %s/%s", self.identity, self.namespace, self.name)
        self._renewed_at = time.monotonic()
        self.leading.set()
        on_started()
        while not stop.wait(self.retry):
            try:
                if self.try_acquire_or_renew():
                    self._renewed_at = time.monotonic()
                    continue
            except Exception as exc:  # noqa: BLE001
                log.warning("leader election: renewing: %s", exc)
            if time.monotonic() - self._renewed_at > self.deadline:
                self.leading.clear()
                log.error("leader election: lost %s/%s (not renewed for %.0fs)", self.namespace, self.name,
                          self.deadline)
                on_lost()
                return

    def release(self) -> None:
        """Give the lease up on a clean stop (the next replica need not wait out its duration)."""
        if not self.leading.is_set():
            return
        try:
            lease = self.rest.json("GET", self.path)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                self.rest.json("PUT", self.path, lease)
        except Exception as exc:  # noqa: BLE001 - it expires on its own
            log.warning("leader election: releasing: %s", exc)
        self.leading.clear()

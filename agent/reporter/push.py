"""Push the capacity to offline systems, off the agent's loop: on every change, and again every
``resend_s`` whatever happened (a ResourceManager or NodeManager that restarted forgot it).

Three kinds of target, from the agent's options:

* a command, as an argument vector (never a shell string): the capacity in
  the target's shape on its stdin, ``TIDAL_VCORES``, ``TIDAL_MEMORY_MB`` (the
  YARN figures, floored at YARN's default minimum allocation),
  ``TIDAL_MILLICPU``, ``TIDAL_MEMORY_BYTES``, ``TIDAL_NODE_STATE`` and
  ``TIDAL_GENERATION`` in its environment. It runs in Tidal's helpers cgroup,
  so its own cpu never counts as online.
* a URL: an HTTP POST of the capacity in the target's shape.
* a YARN ResourceManager (``agent.reporter.yarn``): the node-resource REST
  call itself, with the node found and the RM's minimum allocation read.

Failures are retried per target with exponential backoff (0.5 s doubling to
``max_backoff``); a newer capacity replaces one still waiting to be sent
(only the latest matters). The loop only hands over a document; it never waits
for a target. Each target's record (sent, failures, last error, what it last
sent) is in ``tidal status`` and the metrics.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional

from agent.helper_process import Join, run_helper
from contracts.capacity import render_capacity, yarn_figures

log = logging.getLogger("tidal.push")


class Target:
    """One place the capacity goes; ``send`` raises on failure."""

    kind = "target"

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.last_error: Optional[str] = None
        self.last_ok: Optional[float] = None  # wall clock
        self.last_sent: Optional[Dict[str, Any]] = None
        self.backoff = 0.5

    def send(self, doc: Dict[str, Any]) -> None:
        raise NotImplementedError

    def retry_after(self, exc: Exception) -> Optional[float]:
        """How soon to try again after ``exc``: None for the pusher's growing backoff; a target that knows
        its peer is merely not there yet (no NodeManager registered) asks sooner."""
        return None

    def record(self) -> Dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "sent": self.sent, "failures": self.failures,
                "consecutive_failures": self.consecutive_failures, "last_error": self.last_error,
                "last_ok": self.last_ok, "last_sent": self.last_sent}


class CommandTarget(Target):
    kind = "command"

    def __init__(self, argv: List[str], fmt: str = "yarn", timeout: float = 10.0, join: Optional[Join] = None) -> None:
        super().__init__(argv[0])
        self.argv, self.fmt, self.timeout, self.join = argv, fmt, timeout, join

    def send(self, doc: Dict[str, Any]) -> None:
        shaped = render_capacity(doc, self.fmt)
        vcores, mb, _ = yarn_figures(doc)
        env = dict(os.environ, TIDAL_VCORES=str(vcores), TIDAL_MEMORY_MB=str(mb),
                   TIDAL_MILLICPU=str(doc["reclaimed"]["millicpu"]),
                   TIDAL_MEMORY_BYTES=str(doc["reclaimed"]["memory_bytes"]), TIDAL_NODE_STATE=doc["node_state"],
                   TIDAL_GENERATION=str(doc["generation"]))
        done = run_helper(self.argv, self.join, env, self.timeout, json.dumps(shaped))
        if done.returncode != 0:
            raise RuntimeError(f"{self.argv[0]} exited {done.returncode}: {done.stderr.strip()[:200]}")
        self.last_sent = {"vcores": vcores, "memory_mb": mb}


class UrlTarget(Target):
    kind = "url"

    def __init__(self, url: str, fmt: str = "yarn", timeout: float = 10.0) -> None:
        super().__init__(url)
        self.url, self.fmt, self.timeout = url, fmt, timeout

    def send(self, doc: Dict[str, Any]) -> None:
        shaped = render_capacity(doc, self.fmt)
        request = urllib.request.Request(self.url, data=json.dumps(shaped).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            if response.status >= 300:
                raise RuntimeError(f"{self.url} answered {response.status}")
        self.last_sent = shaped if isinstance(shaped, dict) else {"body": shaped}


class Pusher:
    def __init__(self, targets: List[Target], resend_s: float = 10.0, max_backoff: float = 30.0) -> None:
        if not targets:
            raise ValueError("a pusher needs a target")
        self.targets = targets
        self.resend_s, self.max_backoff = resend_s, max_backoff
        self._pending: Optional[Dict[str, Any]] = None
        self._last: Optional[Dict[str, Any]] = None
        self._due: Dict[int, float] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tidal-push", daemon=True)
        self._thread.start()

    # the totals over every target (the metrics' and older callers' view)
    sent = property(lambda self: sum(t.sent for t in self.targets))
    failures = property(lambda self: sum(t.failures for t in self.targets))
    last_error = property(lambda self: next((t.last_error for t in self.targets if t.consecutive_failures), None))

    def submit(self, doc: Dict[str, Any]) -> None:
        with self._cond:
            self._pending = doc
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def records(self) -> List[Dict[str, Any]]:
        return [t.record() for t in self.targets]

    def _next(self) -> Optional[Dict[str, Any]]:
        """Wait for a new document or a target that is due; None when stopping."""
        with self._cond:
            while not self._stop:
                if self._pending is not None:
                    self._last, self._pending = self._pending, None
                    now = time.monotonic()
                    self._due = {i: now for i in range(len(self.targets))}  # a change goes to every target now
                    return self._last
                if self._last is not None:
                    wait = min(self._due.values()) - time.monotonic()
                    if wait <= 0:
                        return self._last
                    self._cond.wait(wait if wait < 3600 else 3600)
                else:
                    self._cond.wait()
            return None

    def _run(self) -> None:
        while True:
            doc = self._next()
            if doc is None:
                return
            for index, target in enumerate(self.targets):
                if self._due.get(index, 0) > time.monotonic():
                    continue
                try:
                    target.send(doc)
                    target.sent += 1
                    target.consecutive_failures = 0
                    target.last_error = None
                    target.last_ok = time.time()
                    target.backoff = 0.5
                    self._due[index] = time.monotonic() + self.resend_s if self.resend_s > 0 else float("inf")
                except Exception as exc:  # noqa: BLE001 - any failure of the target is retried
                    target.failures += 1
                    target.consecutive_failures += 1
                    target.last_error = str(exc)[:300]
                    soon = target.retry_after(exc)
                    wait = soon if soon is not None else target.backoff
                    if target.consecutive_failures == 1 or soon is None:  # a wait for a peer is said once
                        log.warning("push of capacity generation %s to %s failed (%s); retrying in %.1fs",
                                    doc.get("generation"), target.name, exc, wait)
                    self._due[index] = time.monotonic() + wait
                    if soon is None:
                        target.backoff = min(self.max_backoff, target.backoff * 2)

"""Push every capacity change to an offline system, off the agent's loop.

Two kinds of target, from the agent's options:

* a command, as an argument vector (never a shell string): the capacity JSON
  on its stdin, ``TIDAL_VCORES``, ``TIDAL_MEMORY_MB``, ``TIDAL_MILLICPU``,
  ``TIDAL_NODE_STATE`` and ``TIDAL_GENERATION`` in its environment. For YARN:
  ``["sh", "-c", 'yarn rmadmin -updateNodeResource "$NM" "$TIDAL_MEMORY_MB" "$TIDAL_VCORES"']``
  is the *user's* choice of a shell; Tidal itself runs argv as given.
* a URL: an HTTP POST of the YARN body ``{"vcores": N, "memory-mb": M}`` (or
  the shape named by ``format``), e.g. a small relay that calls the
  ResourceManager's node-resource REST API or feeds a Mesos resource estimator.

Failures are retried with exponential backoff (0.5 s doubling to 30 s); a
newer capacity replaces one still waiting to be sent (only the latest
matters). The loop only hands over a document; it never waits for a target.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

log = logging.getLogger("tidal.push")


class Pusher:
    def __init__(self, command: Optional[List[str]] = None, url: Optional[str] = None, fmt: str = "yarn",
                 timeout: float = 10.0, max_backoff: float = 30.0) -> None:
        if not command and not url:
            raise ValueError("a pusher needs a command or a url")
        self.command, self.url, self.fmt = command, url, fmt
        self.timeout, self.max_backoff = timeout, max_backoff
        self._pending: Optional[Dict[str, Any]] = None
        self._cond = threading.Condition()
        self._stop = False
        self.sent = 0
        self.failures = 0
        self.last_error: Optional[str] = None
        self._thread = threading.Thread(target=self._run, name="tidal-push", daemon=True)
        self._thread.start()

    def submit(self, doc: Dict[str, Any]) -> None:
        with self._cond:
            self._pending = doc
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                while self._pending is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                doc = self._pending
            try:
                self._send(doc)
                self.sent += 1
                backoff = 0.5
                with self._cond:
                    if self._pending is doc:
                        self._pending = None
            except Exception as exc:  # noqa: BLE001 - any failure of the target is retried
                self.failures += 1
                self.last_error = str(exc)
                log.warning("push of capacity generation %s failed (%s); retrying in %.1fs",
                            doc.get("generation"), exc, backoff)
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._pending is not doc, timeout=backoff)
                backoff = min(self.max_backoff, backoff * 2)

    def _send(self, doc: Dict[str, Any]) -> None:
        from contracts.capacity import render_capacity

        shaped = render_capacity(doc, self.fmt)
        if self.command:
            yarn = render_capacity(doc, "yarn")
            env = dict(os.environ, TIDAL_VCORES=str(yarn["vcores"]), TIDAL_MEMORY_MB=str(yarn["memory-mb"]),
                       TIDAL_MILLICPU=str(doc["reclaimed"]["millicpu"]), TIDAL_NODE_STATE=doc["node_state"],
                       TIDAL_GENERATION=str(doc["generation"]))
            done = subprocess.run(self.command, input=json.dumps(shaped), text=True, env=env,
                                  capture_output=True, timeout=self.timeout)
            if done.returncode != 0:
                raise RuntimeError(f"{self.command[0]} exited {done.returncode}: {done.stderr.strip()[:200]}")
        if self.url:
            request = urllib.request.Request(self.url, data=json.dumps(shaped).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                if response.status >= 300:
                    raise RuntimeError(f"{self.url} answered {response.status}")

"""Reusable threads for the API's connections.

The API serves each connection on a thread of its own (a slow client holds
its thread, never another client's). Starting a thread costs its listener's
accept loop a wait until the new thread runs, and that wait is longest when
the agent is busiest: under a flood of reconnections (one local user's slow
clients, each closed at its request deadline and opened again) the accept
loop spent most of its time starting threads, the kernel's accept queue
filled with the flood's connections, and the token holder's request waited
behind them (21 s under the v2 tier's emulation).

``Workers`` keeps a thread that finished a connection waiting for the next
one (for ``idle_s``, then it ends): handing a connection over is a queue put,
and a thread is started only when none is idle. The pool needs no cap of its
own: the listener's connection slots (``agent.connections.Slots``) bound the
connections being served, and so the threads busy.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

log = logging.getLogger("tidal.workers")
IDLE_S = 30.0  # how long a finished thread waits for another connection before it ends


class Workers:
    """Run ``work(*job)`` for each submitted job on an idle thread of the pool, or a new one."""

    def __init__(self, work: Callable[..., Any], name: str, idle_s: float = IDLE_S) -> None:
        self._work = work
        self._name = name
        self._idle_s = idle_s
        self._jobs: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a job that no submitted job has been promised to
        self._threads = 0
        self.started = 0  # threads ever started (reuse = jobs run - started)

    def submit(self, *job: Any) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # an idle thread takes this job
                start = False
            else:
                self._threads += 1
                self.started += 1
                start = True
        if start:  # the thread waits for a job: started first, so a failed start loses none
            try:
                threading.Thread(target=self._loop, name=self._name, daemon=True).start()
            except RuntimeError:
                with self._lock:
                    self._threads -= 1
                raise
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # no job was promised to a waiting thread: this one ends
                        self._idle -= 1
                        self._threads -= 1
                        return
                job = self._jobs.get()  # a job was promised to the waiting threads and is on its way
            try:
                self._work(*job)
            except Exception:  # noqa: BLE001 - one job's failure must not end a thread counted as idle
                log.exception("%s: a job failed", self._name)
            with self._lock:
                self._idle += 1

    def status(self) -> dict:
        with self._lock:
            return {"threads": self._threads, "idle": self._idle, "started": self.started}

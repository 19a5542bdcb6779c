"""Whole-machine lending: the node state machine, persisted.

    Online --lend--> OnlineToOffline --(notice over, online gone)--> Offline
    Offline --reclaim--> OfflineToOnline --(notice over)--> Online

* In the two transition states nothing new is placed.
* OnlineToOffline: online workloads get the notice window to finish
  (``online_policy`` "wait": the node goes Offline once they are gone;
  "evict": the rest are killed when the notice ends). Offline: the whole
  machine minus the reserved pool is reclaimed capacity.
* OfflineToOnline: offline agents see the capacity going to 0 with a
  deadline; when the notice ends, reclaimed workloads still running are killed.
* User hooks (argument vectors, never shell strings) run at each edge with
  ``TIDAL_NODE_FROM``/``TIDAL_NODE_TO`` in their environment, one at a time
  in the order of the edges, on a thread of their own: never under the
  agent's lock (a slow hook must not hold up the loop, the API or the guard).

The state (with the deadline as wall-clock time) is written atomically to
``node.json`` so a restart resumes a transition where it was. The file is
input: a missing file is a first start (Online); one that cannot be read or
fails validation is kept as ``node.json.bad-N`` with a warning and the node
is taken to be lent (Offline: nothing online is placed until an operator
takes it back), since a lent node silently turned Online would take online
work onto a machine offline work still fills.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

import math
import queue
import threading
import time

from agent.errors import AdmissionError, TidalError
from agent.helper_process import run_helper
from agent.statefiles import load_json, write_json

from contracts.states import OFFLINE, ONLINE, STATES, TO_OFFLINE, TO_ONLINE  # noqa: F401 - the shared names


class TransitionError(TidalError):
    """A lend/reclaim that the current node state does not allow."""


@dataclass(frozen=True)
class NodeState:
    state: str = ONLINE
    since: float = 0.0
    deadline: Optional[float] = None
    notice_seconds: float = 0.0

    @property
    def placing(self) -> bool:
        return self.state in (ONLINE, OFFLINE)


def parse_notice(value) -> float:
    """``60``, ``"60"``, ``"60s"``, ``"2m"`` -> seconds; negative or garbage -> AdmissionError."""
    if isinstance(value, bool):
        raise AdmissionError(f"notice must be a duration like 60s, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        scale = 1.0
        for suffix, factor in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
            if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).lstrip("-").isdigit():
                text, scale = text[: -len(suffix)], factor
                break
        try:
            seconds = float(text) * scale
        except ValueError:
            raise AdmissionError(f"notice must be a duration like 60s, got {value!r}") from None
    else:
        raise AdmissionError(f"notice must be a duration like 60s, got {value!r}")
    if seconds < 0 or seconds != seconds or seconds > 7 * 86400:
        raise AdmissionError(f"notice must be between 0 and 7 days, got {value!r}")
    return seconds


def _finite(value, name: str, optional: bool = False) -> Optional[float]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def parse_node_state(data: Any) -> NodeState:
    """``node.json`` (decoded) as a NodeState; ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("state") not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}, got {data.get('state')!r}")
    return NodeState(state=data["state"], since=_finite(data.get("since", 0), "since"),
                     deadline=_finite(data.get("deadline"), "deadline", optional=True),
                     notice_seconds=_finite(data.get("notice_seconds", 0), "notice_seconds"))


class NodeLending:
    def __init__(self, path: str, hooks: Optional[Dict[str, List[str]]] = None) -> None:
        self.path = path
        self.hooks = hooks or {}
        self.current = NodeState()
        self.hook_results: List[Dict[str, object]] = []
        self.helper_join = None  # moves a hook into Tidal's helpers cgroup (agent.helper_process)
        self._hook_queue: "queue.Queue" = queue.Queue()
        self._hook_thread: Optional[threading.Thread] = None

    def load(self) -> Optional[str]:
        """Read ``node.json``; a warning line when it was unusable (see the module docstring)."""
        state, warning = load_json(self.path, parse_node_state, "the node is taken to be lent (Offline) until "
                                                                "`tidal node reclaim` takes it back")
        self.current = state if state is not None else NodeState(state=OFFLINE) if warning else NodeState()
        return warning

    def _save(self) -> None:
        write_json(self.path, asdict(self.current))

    def _enter(self, state: str, now: float, notice: float = 0.0) -> NodeState:
        previous = self.current.state
        self.current = NodeState(state=state, since=now, deadline=now + notice if notice else None,
                                 notice_seconds=notice)
        self._save()
        self._run_hook(previous, state)
        return self.current

    def _run_hook(self, previous: str, state: str) -> None:
        """Queue the hook of ``state``; the hook thread runs them in order, off the caller's lock."""
        argv = self.hooks.get(state)
        if not argv:
            return
        self._hook_queue.put((previous, state, argv))
        if self._hook_thread is None or not self._hook_thread.is_alive():
            self._hook_thread = threading.Thread(target=self._hook_worker, name="tidal-hooks", daemon=True)
            self._hook_thread.start()

    def _hook_worker(self) -> None:
        while True:
            try:
                previous, state, argv = self._hook_queue.get(timeout=5)
            except queue.Empty:
                return
            env = dict(os.environ, TIDAL_NODE_FROM=previous, TIDAL_NODE_TO=state)
            try:
                done = run_helper(argv, self.helper_join, env, timeout=30)
                self.hook_results.append({"state": state, "argv": argv, "exit": done.returncode})
            except (OSError, subprocess.TimeoutExpired) as exc:
                self.hook_results.append({"state": state, "argv": argv, "error": str(exc)})
            del self.hook_results[:-50]
            self._hook_queue.task_done()

    def wait_hooks(self, timeout: float = 60.0) -> bool:
        """Wait until every queued hook has run (tests, and a clean stop); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._hook_queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def lend(self, now: float, notice: float) -> NodeState:
        if self.current.state != ONLINE:
            raise TransitionError(f"cannot lend: the node is {self.current.state}, not Online")
        return self._enter(TO_OFFLINE, now, notice)

    def reclaim(self, now: float, notice: float) -> NodeState:
        if self.current.state not in (OFFLINE, TO_OFFLINE):
            raise TransitionError(f"cannot reclaim: the node is {self.current.state}, not Offline")
        return self._enter(TO_ONLINE, now, notice)

    def advance(self, now: float, online_left: int, reclaimed_left: int, online_policy: str = "wait") -> Optional[str]:
        """Move on when a transition's condition holds. Returns what the caller
        must do first: "evict-online" or "evict-reclaimed", else None."""
        cur = self.current
        expired = cur.deadline is None or now >= cur.deadline
        if cur.state == TO_OFFLINE:
            if online_left == 0 and (expired or online_policy == "wait"):
                self._enter(OFFLINE, now)
            elif expired and online_policy == "evict":
                return "evict-online"
        elif cur.state == TO_ONLINE and expired:
            if reclaimed_left:
                return "evict-reclaimed"
            self._enter(ONLINE, now)
        return None

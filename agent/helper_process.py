"""Tidal's own helper processes (push commands, lending hooks), run where they never count as online.

A helper is started, then moved at once into ``<base>/helpers`` (every
hierarchy), a cgroup on the system cpus whose usage the harvest subtracts from
online demand: a push command that starts a JVM must not become the online
peak that cuts the very capacity it pushes. The move happens right after the
fork: the few milliseconds before it stay where the agent is, which no
sampling period can mistake for a peak. Moving is best effort (a dry run has
no kernel tree); a failure to move is logged once, never fatal.
"""

from __future__ import annotations

import logging
import subprocess
from typing import Callable, Dict, List, Optional

log = logging.getLogger("tidal.helpers")

Join = Callable[[int], None]


class HelperJoin:
    """Moves a helper's pid into the helpers cgroup; set up by the agent once its tree exists."""

    def __init__(self) -> None:
        self.join: Optional[Join] = None
        self.failures = 0

    def __call__(self, pid: int) -> None:
        if self.join is None:
            return
        try:
            self.join(pid)
        except Exception as exc:  # noqa: BLE001 - a helper that ran unconfined is not an error of its own
            self.failures += 1
            if self.failures == 1:
                log.warning("cannot move helper pid %d into the helpers cgroup (%s): its cpu counts as online",
                            pid, exc)


def run_helper(argv: List[str], join: Optional[Join], env: Dict[str, str], timeout: float,
               input_text: Optional[str] = None) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a helper: moved into the helpers cgroup right after it starts."""
    proc = subprocess.Popen(argv, env=env, text=True, stdin=subprocess.PIPE if input_text is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if join is not None:
        join(proc.pid)
    try:
        out, err = proc.communicate(input_text, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)

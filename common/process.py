"""Stopping a child process the way every bench and local control plane here does."""

from __future__ import annotations

import subprocess
from typing import Optional


def terminate(proc: Optional[subprocess.Popen], timeout: float = 30) -> None:
    """SIGTERM ``proc`` and reap it; SIGKILL it if it has not exited within ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

"""The NRI plugin's own Go tests (cmd/tidal-nri): pods found by uid, never by a shortened name, and an
assignment outside the node's cpus or memory nodes never handed to the runtime."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parents[2] / "cmd" / "tidal-nri"


@pytest.mark.skipif(shutil.which("go") is None, reason="needs the Go toolchain (CI has it: make image builds the plugin)")
def test_the_plugins_go_tests_pass():
    done = subprocess.run(["go", "test", "-count=1", "./..."], cwd=PLUGIN, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok" in done.stdout

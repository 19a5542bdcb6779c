"""What a release ships installs and runs on a clean machine: ``make dist``'s wheel (built by
scripts/dist.sh, as PyPA builds it) in a fresh venv, away from the repository, reads a captured node
as the repository's code does, and says the one version pyproject.toml gives."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_into_a_fresh_venv_and_reads_a_node(tmp_path, hwloc_trees):
    version = re.search(r'^version = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    # a copy of the repository's files (those git keeps or would): dist.sh writes its dist/ there, not in the checkout
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = dict(os.environ, TIDAL_DIST_IMAGE="0", PYTHON=sys.executable)
    done = subprocess.run(["sh", "scripts/dist.sh"], cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    wheel = src / "dist" / f"tidal-{version}-py3-none-any.whl"
    sdist = src / "dist" / f"tidal-{version}.tar.gz"
    chart = src / "dist" / f"tidal-{version}.tgz"
    sums = dict(line.split()[::-1] for line in (src / "dist" / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {wheel.name, sdist.name, chart.name}
    for path in (wheel, sdist, chart):
        assert sums[path.name] == hashlib.sha256(path.read_bytes()).hexdigest()
    names = zipfile.ZipFile(wheel).namelist()
    assert "agent/openapi.json" in names and not any(n.startswith("tests/") for n in names)
    with tarfile.open(sdist) as archive:
        assert f"tidal-{version}/pyproject.toml" in archive.getnames()
    with tarfile.open(chart) as archive:
        assert {"tidal/Chart.yaml", "tidal/values.schema.json", "tidal/crds/crd-tidalpolicy.yaml",
                "tidal/files/grafana-dashboard.json"} <= set(archive.getnames())

    # a fresh venv, the wheel from its file (its dependencies from the package index), run from
    # elsewhere with nothing of the repository on its path
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    away = tmp_path / "away"
    away.mkdir()
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    tidal = str(venv / "bin" / "tidal")
    out = subprocess.run([tidal, "--version"], cwd=away, env=clean, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"tidal, version {version}", out.stdout + out.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import agent; print(agent.__file__)"], cwd=away,
                           env=clean, capture_output=True, text=True, timeout=60).stdout
    assert where.startswith(str(venv)), where
    name, root = sorted(hwloc_trees.items())[0]
    out = subprocess.run([tidal, "topology", "--root", root, "--json"], cwd=away, env=clean, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mine = subprocess.run([sys.executable, "-m", "agent.cli", "topology", "--root", root, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout) == json.loads(mine.stdout), name

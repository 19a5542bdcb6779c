"""Tidal's values of a unit that systemd owns survive ``systemctl daemon-reload`` (make test-systemd).

The kubelet's systemd cgroup driver makes each pod's cgroup a transient slice (``StartTransientUnit`` with
``CPUWeight`` and friends); ``daemon-reload`` writes every unit's properties to its cgroup again. This makes
such a slice the way the kubelet does (``busctl``, the same D-Bus call), gives it a member, and runs the
installed Tidal's Reconciler on it with systemd's bus, as the agent does for pods (``isolation.systemd``):
after a reload the kernel still holds Tidal's values, and a revert gives the unit back its own. The whole
road, with a real kubelet, is make test-systemd-kubelet.
"""
import json
import os
import subprocess
import uuid

import pytest

pytestmark = pytest.mark.systemd

PYTHON = "/opt/tidal/venv/bin/python"  # the installed Tidal's (make install)
CGROUP = "/sys/fs/cgroup"

# run by the installed Tidal: apply (or revert) the specs on the slice, print the report, keep the originals
SCRIPT = r"""
import json, sys
from agent.isolation.cgroups.desired import CgroupSpec
from agent.isolation.cgroups.detect import detect
from agent.isolation.cgroups.driver import KernelCgroups
from agent.isolation.cgroups.reconcile import Reconciler
from agent.isolation.systemd import UnitProperties
from agent.topology import HostFS

action, path, kept = sys.argv[1:4]
driver = KernelCgroups(detect(HostFS("/")), HostFS("/"))
driver.features["cpu.idle"] = True  # probed by the agent in its own tree (prepare); this kernel has it
reconciler = Reconciler(driver, "tidal-held-test", units=UnitProperties())
spec = CgroupSpec(path, {"cpu_max": (250000, 100000), "cpu_idle": 1, "memory_high": 900 << 20,
                         "memory_low": 64 << 20}, "pod", external=True)
if action == "apply":
    report = reconciler.apply([spec])
    json.dump(reconciler.export(), open(kept, "w"))
else:
    reconciler.adopt(json.load(open(kept)))
    report = reconciler.revert()
print(json.dumps({"failed": report.failed, "unheld": report.unheld, "held": report.held,
                  "written": report.written, "repaired": report.repaired}))
"""


def sh(*argv):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}"
    return proc.stdout


def tidal_reconcile(action, path, kept):
    return json.loads(sh(PYTHON, "-c", SCRIPT, action, path, kept))


def values(path):
    found = {}
    for knob in ("cpu.idle", "cpu.weight", "cpu.max", "memory.high", "memory.low"):
        with open(f"{CGROUP}/{path}/{knob}") as handle:
            found[knob] = handle.read().strip()
    return found


@pytest.fixture
def pod_slice():
    """A transient slice made as the kubelet makes a pod's (CPUWeight from its shares, accounting on), with
    a sleeping service in it: its cgroup exists while it has a member."""
    name = f"tidalheld{uuid.uuid4().hex[:8]}"
    sh("busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
       "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))", f"{name}.slice", "replace",
       "4", "CPUWeight", "t", "20", "CPUAccounting", "b", "true", "MemoryAccounting", "b", "true",
       "Description", "s", "a pod's slice, as the kubelet makes it", "0")
    sh("systemd-run", f"--unit={name}-member", f"--slice={name}.slice", "sleep", "600")
    yield f"{name}.slice"
    subprocess.run(["systemctl", "stop", f"{name}-member.service", f"{name}.slice"], capture_output=True)


def test_a_units_values_held_by_systemd_survive_daemon_reload_and_revert_gives_its_own_back(pod_slice, tmp_path):
    kept = str(tmp_path / "originals.json")
    before = values(pod_slice)
    assert before["cpu.idle"] == "0" and before["cpu.weight"] == "20" and before["cpu.max"] == "max 100000"
    report = tidal_reconcile("apply", pod_slice, kept)
    assert not report["failed"] and not report["unheld"], report
    assert {name for _, name, _ in report["held"]} == {"CPUWeight", "CPUQuotaPerSecUSec", "MemoryHigh",
                                                       "MemoryLow"}, report
    tidals = {"cpu.idle": "1", "cpu.max": "250000 100000", "memory.high": str(900 << 20),
              "memory.low": str(64 << 20)}
    after = values(pod_slice)
    assert {k: after[k] for k in tidals} == tidals
    shown = sh("systemctl", "show", pod_slice, "--property=CPUWeight,CPUQuotaPerSecUSec,MemoryHigh,MemoryLow")
    print(shown)
    assert f"MemoryHigh={900 << 20}" in shown and f"MemoryLow={64 << 20}" in shown, shown
    sh("systemctl", "daemon-reload")
    assert values(pod_slice) == after, "systemd wrote the unit's own values back at daemon-reload"
    # a second pass finds nothing to repair
    again = tidal_reconcile("apply", pod_slice, str(tmp_path / "again.json"))
    assert not again["repaired"] and not again["written"] and not again["held"], again
    report = tidal_reconcile("revert", pod_slice, kept)
    assert not report["failed"], report
    assert values(pod_slice) == before
    sh("systemctl", "daemon-reload")
    assert values(pod_slice) == before, "the unit's own values are not what systemd holds after the revert"

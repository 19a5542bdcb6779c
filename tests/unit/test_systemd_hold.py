"""systemd holding Tidal's values of the kubelet's units (isolation.systemd.UnitProperties under the Reconciler).

Found by make test-systemd-kubelet: under the kubelet's systemd driver each ``systemctl daemon-reload`` wrote
every pod slice's unit properties back to its cgroup (a reclaimed pod's ``cpu.idle``, online's
``memory.low``), and Tidal repaired them in turn: 16 repairs in 180 s. Here systemd is a fake that keeps unit
properties and, at ``reload()``, writes them to the in-memory cgroups as systemd 252 does.
"""
import pytest

from agent.isolation.cgroups.desired import CgroupSpec
from agent.isolation.cgroups.reconcile import SYSTEMD, Reconciler
from agent.isolation.cgroups.recording import RecordingCgroups
from agent.isolation.systemd import INFINITY, SystemdError, UnitProperties, cgroup_properties

POD = "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-poduid.slice"
WEB = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podweb.slice"


class FakeSystemd:
    """Units' uint64 properties, as the kubelet made them; ``reload()`` writes them to the cgroups."""

    def __init__(self, driver, units):
        self.driver = driver
        self.units = {unit: dict(props) for unit, props in units.items()}
        self.paths = {}
        self.calls = []
        self.down = False

    def get_properties(self, unit, names):
        if self.down:
            raise SystemdError("systemd's bus (system): FileNotFoundError: no socket")
        self.calls.append(("get", unit, tuple(names)))
        return {name: self.units[unit][name] for name in names}

    def set_properties(self, unit, values):
        if self.down:
            raise SystemdError("systemd's bus (system): FileNotFoundError: no socket")
        self.calls.append(("set", unit, tuple(values)))
        self.units[unit].update(values)

    def reload(self):
        for path in [p for p in self.driver.files if p.rsplit("/", 1)[-1] in self.units]:
            props = self.units[path.rsplit("/", 1)[-1]]
            weight = props["CPUWeight"]
            self.driver.write("", path, "cpu.idle", "1" if weight == 0 else "0")
            if weight not in (0, INFINITY):
                self.driver.write("", path, "cpu.weight", str(weight))
            quota = props["CPUQuotaPerSecUSec"]
            self.driver.write("", path, "cpu.max", "max 100000" if quota == INFINITY else f"{quota // 10} 100000")
            for prop, file in (("MemoryLow", "memory.low"), ("MemoryHigh", "memory.high")):
                self.driver.write("", path, file, "max" if props[prop] == INFINITY else str(props[prop]))


def kubelets_units():
    return {"kubepods-besteffort-poduid.slice": {"CPUWeight": 1, "CPUQuotaPerSecUSec": INFINITY, "MemoryLow": 0,
                                                  "MemoryHigh": INFINITY},
            "kubepods-burstable-podweb.slice": {"CPUWeight": 20, "CPUQuotaPerSecUSec": INFINITY, "MemoryLow": 0,
                                                "MemoryHigh": INFINITY}}


def node(version=2):
    driver = RecordingCgroups(version=version)
    for path in ("kubepods.slice", "kubepods.slice/kubepods-besteffort.slice", POD,
                 "kubepods.slice/kubepods-burstable.slice", WEB):
        driver.create(path)
    systemd = FakeSystemd(driver, kubelets_units())
    systemd.reload()  # the values the kubelet's units gave the cgroups
    return driver, systemd


SPECS = [CgroupSpec("tidal", {"cpus": "0-3", "mems": "0"}),
         CgroupSpec(POD, {"cpu_max": (250_000, 100_000), "cpu_idle": 1, "memory_high": 900 << 20}, "batch",
                    external=True),
         CgroupSpec(WEB, {"memory_low": 64 << 20}, "web", external=True)]


@pytest.mark.parametrize("file,text,expected", [
    ("cpu.idle", "1", [("CPUWeight", 0)]),
    ("cpu.idle", "0", []),
    ("cpu.weight", "39", [("CPUWeight", 39)]),
    ("cpu.max", "250000 100000", [("CPUQuotaPerSecUSec", 2_500_000)]),
    ("cpu.max", "1000 100000", [("CPUQuotaPerSecUSec", 10_000)]),
    ("cpu.max", "max 100000", [("CPUQuotaPerSecUSec", INFINITY)]),
    ("cpu.max", "5000 50000", [("CPUQuotaPerSecUSec", 100_000), ("CPUQuotaPeriodUSec", 50_000)]),
    ("memory.low", "max", [("MemoryLow", INFINITY)]),
    ("memory.high", "943718400", [("MemoryHigh", 943718400)]),
    ("cpuset.cpus", "0-3", []),
    ("io.max", "8:0 rbps=1 wbps=max", []),
])
def test_the_properties_that_make_systemd_write_a_files_value(file, text, expected):
    assert cgroup_properties(file, text) == expected


def test_a_value_that_is_not_the_files_is_refused():
    with pytest.raises(ValueError):
        cgroup_properties("cpu.max", "lots 100000")
    with pytest.raises(ValueError):
        cgroup_properties("cpu.max", "1000 0")


def test_without_systemd_holding_them_a_reload_undoes_tidals_values_and_each_is_repaired():
    """The finding, as it was: the test below fails on this behaviour."""
    driver, systemd = node()
    reconciler = Reconciler(driver, "tidal")
    assert reconciler.apply(SPECS).ok
    systemd.reload()
    report = reconciler.apply(SPECS)
    assert {(path, file) for path, file, _, _ in report.repaired} == {
        (POD, "cpu.max"), (POD, "cpu.idle"), (POD, "memory.high"), (WEB, "memory.low")}


def test_systemd_holds_what_tidal_wrote_so_a_reload_writes_the_same():
    driver, systemd = node()
    reconciler = Reconciler(driver, "tidal", units=UnitProperties(systemd))
    report = reconciler.apply(SPECS)
    assert report.ok and not report.unheld
    assert systemd.units["kubepods-besteffort-poduid.slice"] == {
        "CPUWeight": 0, "CPUQuotaPerSecUSec": 2_500_000, "MemoryLow": 0, "MemoryHigh": 900 << 20}
    assert systemd.units["kubepods-burstable-podweb.slice"]["MemoryLow"] == 64 << 20
    assert {(path, name) for path, name, _ in report.held} == {
        (POD, "CPUWeight"), (POD, "CPUQuotaPerSecUSec"), (POD, "MemoryHigh"), (WEB, "MemoryLow")}
    # Tidal's own tree is no unit of systemd's: never asked
    assert all(unit.endswith(".slice") for _, unit, _ in systemd.calls)
    before = dict(driver.files[POD]), dict(driver.files[WEB])
    systemd.reload()
    assert (driver.files[POD], driver.files[WEB]) == before
    report = reconciler.apply(SPECS)
    assert not report.repaired and not report.written and not report.held


def test_the_units_values_before_are_kept_once_survive_a_restart_and_come_back_on_revert(tmp_path):
    driver, systemd = node()
    reconciler = Reconciler(driver, "tidal", units=UnitProperties(systemd))
    assert reconciler.apply(SPECS).ok
    moved = [CgroupSpec(s.path, {**s.knobs, "cpu_max": (100_000, 100_000)}, s.workload, s.external)
             if s.path == POD else s for s in SPECS]
    assert reconciler.apply(moved).ok  # the quota follows the capacity: held again, its original kept as it was
    assert reconciler.originals[(POD, SYSTEMD, "CPUQuotaPerSecUSec")] == str(INFINITY)
    assert systemd.units["kubepods-besteffort-poduid.slice"]["CPUQuotaPerSecUSec"] == 1_000_000
    # a restarted agent reverts from what the first one kept (the checkpoint's originals)
    successor = Reconciler(driver, "tidal", units=UnitProperties(systemd))
    successor.adopt(reconciler.export())
    report = successor.revert()
    assert report.ok, report.failed
    assert systemd.units == kubelets_units()
    assert driver.files[POD][("", "cpu.idle")] == "0" and driver.files[POD][("", "cpu.max")] == "max 100000"


def test_a_bus_that_is_away_is_asked_again_later_and_the_files_hold_meanwhile():
    driver, systemd = node()
    clock = [0.0]
    reconciler = Reconciler(driver, "tidal", units=UnitProperties(systemd, clock=lambda: clock[0]))
    systemd.down = True
    report = reconciler.apply(SPECS)
    assert report.ok and report.unheld and not report.held
    assert driver.files[POD][("", "cpu.idle")] == "1"  # the files are written all the same
    systemd.down = False
    report = reconciler.apply(SPECS)
    assert not report.held, "asked again before the retry interval"
    clock[0] += UnitProperties.RETRY_S
    report = reconciler.apply(SPECS)
    assert {(path, name) for path, name, _ in report.held} == {
        (POD, "CPUWeight"), (POD, "CPUQuotaPerSecUSec"), (POD, "MemoryHigh"), (WEB, "MemoryLow")}
    systemd.reload()
    assert not reconciler.apply(SPECS).repaired


def test_cgroup_v1_and_the_cgroupfs_driver_never_dial_systemd():
    driver, systemd = node(version=1)
    assert Reconciler(driver, "tidal", units=UnitProperties(systemd)).apply(SPECS).ok
    flat = RecordingCgroups(version=2)
    flat.create("kubepods/besteffort/poduid")
    spec = CgroupSpec("kubepods/besteffort/poduid", {"cpu_idle": 1}, "batch", external=True)
    assert Reconciler(flat, "tidal", units=UnitProperties(systemd)).apply([spec]).ok
    assert systemd.calls == []


def test_a_saved_property_that_is_no_number_is_one_failure_and_the_rest_is_given_back():
    driver, systemd = node()
    reconciler = Reconciler(driver, "tidal", units=UnitProperties(systemd))
    assert reconciler.apply(SPECS).ok
    reconciler.originals[(POD, SYSTEMD, "MemoryHigh")] = "lots"  # a corrupt originals.json, adopted
    report = reconciler.revert()
    assert [(path, file) for path, file, _ in report.failed] == [(POD, SYSTEMD)]
    assert "MemoryHigh" in report.failed[0][2]
    assert systemd.units["kubepods-burstable-podweb.slice"] == kubelets_units()["kubepods-burstable-podweb.slice"]
    assert systemd.units["kubepods-besteffort-poduid.slice"]["CPUWeight"] == 1


def test_a_unit_systemd_refuses_does_not_hold_back_the_others():
    """A refusal (the kubelet removed the pod's slice a moment ago) is that unit's alone: the next unit is asked
    in the same pass; only a bus that does not answer makes every call wait the retry interval."""
    from agent.isolation.systemd import SystemdRefused

    driver, systemd = node()
    refuse = systemd.set_properties

    def set_properties(unit, values):
        if unit == "kubepods-besteffort-poduid.slice":
            raise SystemdRefused("systemd refused SetUnitProperties: org.freedesktop.systemd1.NoSuchUnit")
        return refuse(unit, values)

    systemd.set_properties = set_properties
    report = Reconciler(driver, "tidal", units=UnitProperties(systemd, clock=lambda: 0.0)).apply(SPECS)
    assert {path for path, _ in report.unheld} == {POD}
    assert [(path, name) for path, name, _ in report.held] == [(WEB, "MemoryLow")]

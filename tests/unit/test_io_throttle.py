"""The io throttle (cut on online io pressure, grown back slowly) and cgroup v2's block io files."""

import pytest

from agent.isolation.cgroups.blockio import parse_io_max, parse_io_stat, read_io_bytes, read_io_limits
from agent.isolation.cgroups.desired import CgroupSpec
from agent.isolation.cgroups.recording import RecordingCgroups
from agent.isolation.cgroups.knobs import files_for, line_writes, satisfied
from agent.isolation.cgroups.reconcile import Reconciler
from agent.services.io_throttle import CEILING, FLOOR, QUIET_PERIODS, IoThrottle

MIB = 1 << 20


def test_a_pressure_window_limits_each_device_and_direction_offline_used():
    throttle = IoThrottle(20.0)
    rates = {"8:0": (200 * MIB, 0.0), "8:16": (0.0, 40 * MIB)}
    assert not throttle.on_pressure(19.9, rates) and not throttle.limits  # under the threshold
    assert not throttle.on_pressure(None, rates)  # no PSI figure
    assert not throttle.on_pressure(90.0, {})  # offline moved nothing: online waits on its own io
    assert throttle.on_pressure(20.0, rates)
    assert throttle.limits == {"8:0": (100 * MIB, None), "8:16": (None, 20 * MIB)}
    assert throttle.cuts == 1 and throttle.last_trigger == 20.0
    # the next window runs at the limit and online still waits: halved again
    assert throttle.on_pressure(30.0, {"8:0": (100 * MIB, 0.0)})
    assert throttle.limits["8:0"] == (50 * MIB, None) and throttle.limits["8:16"] == (None, 20 * MIB)
    # a window in which offline's rate reads above its limit (one large request counted in a short window)
    # while online still waits: halved from the limit, not from the reading (which would hold it where it is)
    assert throttle.on_pressure(30.0, {"8:0": (150 * MIB, 0.0)})
    assert throttle.limits["8:0"] == (25 * MIB, None)
    # a window in which offline ran under its limit: halved from its rate; the direction it did not use stays
    assert throttle.on_pressure(30.0, {"8:0": (10 * MIB, 0.0), "8:16": (0.0, 0.0)})
    assert throttle.limits == {"8:0": (5 * MIB, None), "8:16": (None, 20 * MIB)}
    # pressure with offline idle on the device: nothing it did, nothing cut
    assert not throttle.on_pressure(30.0, {"8:0": (0.0, 0.0)})
    assert throttle.limits["8:0"] == (5 * MIB, None)


def test_limits_never_fall_under_the_floor_and_are_page_multiples():
    throttle = IoThrottle(10.0)
    throttle.on_pressure(50.0, {"8:0": (1.5 * MIB, 3 * MIB + 123)})
    read_, write = throttle.limits["8:0"]
    assert read_ == FLOOR and write % 4096 == 0 and FLOOR <= write < 3 * MIB
    assert not throttle.on_pressure(50.0, {"8:0": (FLOOR, 0.0)})  # reads at the floor: nothing lower


def test_limits_grow_back_after_quiet_periods_and_are_lifted_at_the_ceiling():
    throttle = IoThrottle(20.0)
    throttle.on_pressure(40.0, {"8:0": (8 * MIB, 4 * MIB)})
    before = dict(throttle.limits)
    for _ in range(QUIET_PERIODS - 1):
        assert not throttle.on_period(5.0)
    assert not throttle.on_period(10.0)  # half the threshold is not quiet: the count starts over
    assert throttle.limits == before
    for _ in range(QUIET_PERIODS - 1):
        assert not throttle.on_period(None)
    assert throttle.on_period(0.0)
    assert throttle.limits == {"8:0": (8 * MIB, 4 * MIB)}
    periods = 0
    while throttle.limits:
        assert throttle.on_period(0.0)
        periods += 1
        assert all(v is None or v < CEILING for pair in throttle.limits.values() for v in pair)
    assert periods == 8  # 8 MiB/s doubles to the 1 GiB/s ceiling in 7 periods; 4 MiB/s in 8
    assert throttle.lifted(before) == {"8:0": (None, None)}
    assert not throttle.on_period(0.0)  # nothing left to grow


def test_off_at_zero():
    throttle = IoThrottle(0.0)
    assert not throttle.on_pressure(100.0, {"8:0": (MIB, MIB)}) and not throttle.limits


def test_the_kernel_files_parse():
    assert parse_io_stat("254:0 rbytes=4096 wbytes=8192 rios=1 wios=2 dbytes=0 dios=0\n"
                         "7:0 rbytes=10 wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n") == \
        {"254:0": (4096, 8192), "7:0": (10, 0)}
    assert parse_io_stat("") == {} and parse_io_stat(None) is None
    assert parse_io_stat("254:0 rbytes=x\n") == {}
    assert parse_io_max("254:0 rbps=1048576 wbps=max riops=max wiops=max\n7:0 rbps=max wbps=max riops=10 wiops=max\n") \
        == {"254:0": (MIB, None)}  # an iops limit is not Tidal's, and not a bandwidth limit
    assert parse_io_max("garbage\n") == {} and parse_io_max("8:0 rbps=x\n") == {}


def test_io_max_is_a_knob_of_lines_one_device_per_write():
    assert files_for(2, "io_max", (("254:0", 2 * MIB, None), ("8:0", None, MIB))) == \
        [("", "io.max", "254:0 rbps=2097152 wbps=max\n8:0 rbps=max wbps=1048576")]
    assert files_for(2, "io_max", ()) == [("", "io.max", "")] and files_for(1, "io_max", (("8:0", 1, 1),)) == []
    # only the lines that differ are written; a device limited there and not wanted is lifted
    assert line_writes("io.max", "254:0 rbps=5 wbps=max riops=max wiops=max\n8:0 rbps=max wbps=7",
                       "8:0 rbps=max wbps=7\n8:16 rbps=9 wbps=max") == ["254:0 rbps=max wbps=max", "8:16 rbps=9 wbps=max"]
    assert line_writes("io.max", None, "") == [] and line_writes("cpu.max", "max 100000", "1000 100000") == ["1000 100000"]
    assert satisfied("io.max", "8:0 rbps=7 wbps=max riops=max wiops=max\n", "8:0 rbps=7 wbps=max")
    assert satisfied("io.max", "8:0 rbps=max wbps=max riops=10 wiops=max\n", "")  # an iops limit is not Tidal's
    assert satisfied("io.max", None, "") and not satisfied("io.max", None, "8:0 rbps=7 wbps=max")
    assert not satisfied("io.max", "8:0 rbps=7 wbps=max", "8:0 rbps=8 wbps=max")


def test_the_reconciler_writes_io_limits_keeps_others_originals_repairs_drift_and_reverts():
    driver = RecordingCgroups(version=2, features={"cpu.idle": True, "memory": True, "io": True})
    driver.create("kubepods/pod1")
    driver.files["kubepods/pod1"][("", "io.max")] = "8:16 rbps=max wbps=5 riops=max wiops=max"  # someone else's
    reconciler = Reconciler(driver, "t")
    limits = (("254:0", 40 * MIB, None),)
    specs = lambda io: [CgroupSpec("t", {}), CgroupSpec("t/reclaimed", {"io_max": io}),  # noqa: E731
                        CgroupSpec("kubepods/pod1", {"io_max": io}, "pod/1", external=True)]
    assert reconciler.apply(specs(limits)).ok
    writes = [op[1:] for op in driver.ops if op[0] == "write"]
    assert writes == [("t/reclaimed", "", "io.max", "254:0 rbps=41943040 wbps=max"),
                      ("kubepods/pod1", "", "io.max", "254:0 rbps=41943040 wbps=max"),
                      ("kubepods/pod1", "", "io.max", "8:16 rbps=max wbps=max")]  # the whole file is Tidal's
    assert read_io_limits(driver, "t/reclaimed") == read_io_limits(driver, "kubepods/pod1") == {"254:0": (40 * MIB, None)}
    driver.ops.clear()
    assert reconciler.apply(specs(limits), verify=True).written == []  # nothing differs: nothing written
    driver.files["t/reclaimed"][("", "io.max")] = ""  # someone lifted it
    report = reconciler.apply(specs(limits), verify=True)
    assert report.repaired == [("t/reclaimed", "io.max", "", "254:0 rbps=41943040 wbps=max")]
    assert reconciler.apply(specs(())).ok  # the throttle lifted: every device line lifted
    assert read_io_limits(driver, "t/reclaimed") == read_io_limits(driver, "kubepods/pod1") == {}
    assert reconciler.apply(specs(limits)).ok
    assert reconciler.revert().ok
    assert "t/reclaimed" not in driver.files
    assert read_io_limits(driver, "kubepods/pod1") == {"8:16": (None, 5)}  # as found


def test_the_guard_measures_offline_io_and_hands_its_limits_to_the_tree():
    from agent.services.io_guard import IoGuard

    driver = RecordingCgroups(version=2, features={"cpu.idle": True, "memory": True, "io": True})
    for path in ("t/reclaimed", "kubepods/pod1"):
        driver.create(path)
    paths = ["t/reclaimed", "kubepods/pod1"]
    guard = IoGuard(driver, lambda: list(paths), 20.0)
    stat = lambda r: f"254:0 rbytes={r} wbytes=0 rios=1 wios=0\n"  # noqa: E731
    driver.files["t/reclaimed"][("", "io.stat")] = stat(0)
    driver.files["kubepods/pod1"][("", "io.stat")] = stat(0)
    assert not guard.on_window(50.0, 10.0)  # the first window: no rate yet
    driver.files["t/reclaimed"][("", "io.stat")] = stat(30 * MIB)
    driver.files["kubepods/pod1"][("", "io.stat")] = stat(10 * MIB)
    assert guard.on_window(50.0, 10.5)  # 80 MiB/s from both: limited to half
    assert guard.rates == {"254:0": (80 * MIB, 0.0)}
    # each window is kept with its share and whether offline moved data; the cut's window and time
    assert list(guard.recent) == [(1, 50.0, False), (2, 50.0, True)] and (guard.cut_window, guard.cut_at) == (2, 10.5)
    assert guard.knob() == (("254:0", 40 * MIB, None),)
    assert not [op for op in driver.ops if op[0] == "write"]  # the guard writes nothing itself
    assert guard.lift_all() and guard.knob() == () and not guard.lift_all()
    off = IoGuard(RecordingCgroups(version=1), lambda: ["t/reclaimed"], 20.0)  # v1: shown only
    assert not off.active


def test_the_agent_lifts_stale_limits_at_start_writes_the_guards_and_lifts_them_on_stop(make_agent):
    from tests.unit.test_capacity_api import TOPO

    driver = RecordingCgroups(version=2, features={"cpu.idle": True, "memory": True, "io": True})
    driver.create("tidal/reclaimed")
    driver.files["tidal/reclaimed"][("", "io.max")] = "254:0 rbps=1048576 wbps=max"  # left by an earlier agent
    lines = []
    agent = make_agent(TOPO, driver=driver, echo=lines.append, memory_reserved_bytes=0)
    try:
        assert "tidal agent: lifted 1 io limits an earlier agent left (tidal/reclaimed 254:0)" in lines, lines
        assert read_io_limits(driver, "tidal/reclaimed") == {}
        agent.harvest.io_guard.throttle.limits = {"254:0": (2 * MIB, None)}
        agent.reconcile()
        assert read_io_limits(driver, "tidal/reclaimed") == {"254:0": (2 * MIB, None)}
    finally:
        agent.shutdown()
    assert read_io_limits(driver, "tidal/reclaimed") == {}  # a clean stop keeps the tree, not the limits


def test_status_and_metrics_show_io_limits_and_confined_workloads(make_agent):
    from click.testing import CliRunner

    from agent.cli import main
    from agent.reporter.metrics import render
    from tests.unit.test_capacity_api import serving

    agent = serving(make_agent)
    try:
        agent.admit({"name": "scan", "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"})
        agent.harvest.io_guard.throttle.limits = {"254:0": (2 * MIB, None)}
        agent.harvest.kernel_work.confined = {"scan": 0}
        agent.harvest.kernel_work.kernel_millicpu = {"scan": 42}
        out = CliRunner().invoke(main, ["status", "--socket", agent.config.socket_path]).output
        assert "offline io LIMITED: 254:0 read 2.0 MiB/s write -" in out, out
        assert "online io pressure - (no PSI)" in out  # the recording driver keeps none
        assert "kept off online's idle cpus (it runs in the kernel): scan (42 millicpu in the kernel)" in out, out
        status = agent.status()
        assert status["io_pressure"]["limits"] == {"254:0": {"read_bps": 2 * MIB, "write_bps": None}}
        assert status["kernel_work"]["confined"] == ["scan"]
        text = render(agent).decode()
        assert 'tidal_offline_io_limit_bytes_per_second{device="254:0",direction="read"} 2.097152e+06' in text, text
        assert "tidal_reclaimed_confined_workloads 1.0" in text
        assert "tidal_io_pressure_throttles_total 0.0" in text
    finally:
        agent.shutdown()

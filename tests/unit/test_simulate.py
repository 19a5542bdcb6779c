"""The tidal-day simulator: the gain, the buffer knob, traces and their errors."""

import json
import subprocess
import sys

import pytest

from cluster.simulate import SimConfig, TraceError, diurnal, read_trace, run, simulate
from contracts.errors import TidalError

SMALL = dict(nodes=120, cores=32, hours=24.0)


@pytest.fixture(scope="module")
def default_day():
    return simulate(SimConfig(**SMALL))


def test_colocation_raises_utilisation_with_no_online_shortfall(default_day):
    separate, tidal = default_day["separate"], default_day["tidal"]
    assert tidal["avg_util"] > separate["avg_util"] + 0.1
    assert tidal["online_shortfall_core_hours"] == 0.0
    assert separate["online_shortfall_core_hours"] == 0.0
    assert tidal["offline_core_hours"] > separate["offline_core_hours"]
    assert tidal["lent_node_hours"] > 0  # whole machines were lent in the night valley
    assert len(tidal["hourly_util"]) == 24


def test_without_the_safety_buffer_online_waits_for_its_cores(default_day):
    bare = simulate(SimConfig(buffer=0.0, **SMALL))["tidal"]
    assert bare["online_shortfall_core_hours"] > 0
    assert bare["online_waits_node_minutes"] > 0
    assert default_day["tidal"]["online_waits_node_minutes"] == 0


def test_the_curve_has_its_valley_and_evening_peak():
    config = SimConfig()
    import numpy as np

    shape = diurnal(config, np.arange(24 * 60))
    assert abs(shape[4 * 60] - 0.3) < 1e-9 and abs(shape[20 * 60] - 1.0) < 1e-9
    assert shape.argmax() == 20 * 60 and shape.argmin() == 4 * 60


HEADER = "minute,kind,name,cores,duration_min,tier,node\n"


def write(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_trace_replays(tmp_path):
    # web ramps 200 -> 500 cores over the day in 20-core steps every 40 minutes
    rows = [HEADER] + [f"{m},online,web,{200 + 20 * (m // 40) if m < 600 else 500},,,\n" for m in range(0, 1440, 40)]
    rows += [f"{m},offline,j{m},8,60,low,\n" for m in range(0, 1440, 10)]
    rows.append("30,offline,pinned,4,30,high,node-3\n")
    trace = read_trace(write(tmp_path, "".join(rows)), 40)
    assert trace.online["web"][1] == (40, 220.0) and trace.jobs[0].name == "j0"
    result = simulate(SimConfig(nodes=40, cores=32), trace)
    assert result["tidal"]["offline_core_hours"] > result["separate"]["offline_core_hours"] > 0
    assert result["tidal"]["online_shortfall_core_hours"] == 0.0


def test_a_step_in_demand_faster_than_the_lending_notice_is_short_until_nodes_come_back(tmp_path):
    rows = [HEADER, "0,online,web,100,,,\n", "600,online,web,500,,,\n"]
    trace = read_trace(write(tmp_path, "".join(rows)), 40)
    result = simulate(SimConfig(nodes=40, cores=32, offline_demand_share=0.2), trace)
    tidal = result["tidal"]
    assert result["separate"]["online_shortfall_core_hours"] == 0.0  # its pool was sized for the peak
    # lent machines come back only after the notice: online is short for about that long, no longer
    notice_h = SimConfig().notice_minutes / 60
    assert 0 < tidal["online_shortfall_by_cause"]["unplaced"] <= 400 * notice_h


@pytest.mark.parametrize("text, message", [
    ("minute,kind,name,cores\n0,online,web,3\n", r"t.csv:1: missing column\(s\) duration_min, tier, node"),
    (HEADER + "0,online,web,100,,,\n5,online,web,-3,,,\n", r"t.csv:3: negative demand"),
    (HEADER + "0,offline,j,4,30,low,node-99\n", r"t.csv:2: unknown node id 'node-99'"),
    (HEADER + "0,offline,j,4,30,urgent,\n", r"t.csv:2: tier 'urgent'"),
    (HEADER + "x,online,web,1,,,\n", r"t.csv:2: minute and cores must be numbers"),
    (HEADER + "0,batch,j,1,,,\n", r"t.csv:2: kind 'batch'"),
], ids=["missing-columns", "negative-demand", "unknown-node", "bad-tier", "not-a-number", "bad-kind"])
def test_bad_traces_name_the_line(tmp_path, text, message):
    with pytest.raises(TraceError, match=message):
        read_trace(write(tmp_path, text), 10)


def test_cli_json_shape_and_plot(tmp_path):
    png = tmp_path / "day.png"
    done = subprocess.run([sys.executable, "-m", "agent.cli", "cluster", "simulate", "--nodes", "60", "--cores", "16",
                           "--hours", "24", "--json", "--plot", str(png)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    for mode in ("separate", "tidal"):
        assert set(data[mode]) >= {"avg_util", "online_shortfall_core_hours", "offline_core_hours"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_bad_trace_is_one_error_line(tmp_path):
    path = write(tmp_path, HEADER + "0,offline,j,4,30,low,node-5000\n")
    done = subprocess.run([sys.executable, "-m", "agent.cli", "cluster", "simulate", "--nodes", "10", "--trace", path],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"tidal: error: {path}:2: unknown node id 'node-5000' (the cluster has node-0 .. node-9)"


def test_lending_with_no_notice_lends_and_takes_back_as_labelled_and_a_long_period_decides_on_its_minutes():
    base = dict(nodes=6, cores=14, hours=24, noise=0.0, online_peak_share=0.5, replica_cores=2, notice_minutes=0)
    every_minute = run(SimConfig(**base, lending_period_s=60.0), "tidal")
    half_hourly = run(SimConfig(**base, lending_period_s=1800.0), "tidal")
    for result in (every_minute, half_hourly):
        labelled = [int(n) for n in result["offline_labelled_by_minute"]][result["warmup_minutes"]:]
        assert labelled[4 * 60] >= 3 and labelled[20 * 60] == 0, labelled[::60]
        # with no notice a node labelled Offline is lent that minute: the two figures are one
        assert result["lent_node_hours"] == pytest.approx(sum(labelled) / 60.0, abs=0.05)
    # a half-hourly controller changes its mind only in the minutes that start a period
    changes = [m for m, (a, b) in enumerate(zip(half_hourly["offline_labelled_by_minute"],
                                                  half_hourly["offline_labelled_by_minute"][1:]), 1) if a != b]
    assert changes and all(m % 30 == 0 for m in changes), changes
    with pytest.raises(TidalError):
        SimConfig(notice_minutes=-1).check()

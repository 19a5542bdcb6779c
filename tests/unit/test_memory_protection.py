"""Memory: eviction on the watermark and on online memory pressure (by tier, the largest first), the
PSI meter, the protection and throttling knobs of the desired tree, the size option."""

import os
import subprocess
import sys

import pytest

from agent.isolation.cgroups.desired import CgroupOptions, desired_tree
from agent.isolation.cgroups.knobs import files_for, normalize
from agent.qrm.eviction import choose_memory_victims
from agent.qrm.model import Allocation, QoS, Tier
from agent.qrm.policy import initial_state, pools
from agent.reporter.pressure import PressureMeter
from agent.services.eviction import default_watermark
from tests.unit.test_capacity_api import serving

MIB = 1 << 20
GIB = 1 << 30


def reclaimed(name, tier):
    return Allocation(name=name, qos=QoS.RECLAIMED, millicpu=100, tier=Tier(tier))


def test_memory_victims_go_by_tier_then_size_until_enough_is_freed():
    allocs = [reclaimed("low-small", "low"), reclaimed("high-big", "high"), reclaimed("low-big", "low"),
              reclaimed("min-mid", "min"), Allocation(name="web", qos=QoS.SHARED, millicpu=1000)]
    use = {"low-small": 100 * MIB, "high-big": 4 * GIB, "low-big": 1 * GIB, "min-mid": 500 * MIB, "web": 8 * GIB}
    names = lambda need: [a.name for a in choose_memory_victims(allocs, use, need)]  # noqa: E731
    assert names(0) == []
    assert names(1) == ["low-big"]
    assert names(1 * GIB) == ["low-big"]
    assert names(1 * GIB + 1) == ["low-big", "low-small"]
    assert names(1 * GIB + 200 * MIB) == ["low-big", "low-small", "min-mid"]
    assert names(100 * GIB) == ["low-big", "low-small", "min-mid", "high-big"]  # never "web": online


def test_memory_victims_skip_what_frees_nothing():
    allocs = [reclaimed("idle", "low"), reclaimed("unknown", "low"), reclaimed("user", "high")]
    assert [a.name for a in choose_memory_victims(allocs, {"idle": 0, "unknown": None, "user": MIB}, GIB)] == ["user"]


def test_default_watermark_sits_between_the_kubelets_threshold_and_a_ceiling():
    assert default_watermark(1 * GIB) == 256 * MIB  # the VM tier's 1 GiB
    assert default_watermark(24 * GIB) == 24 * GIB * 2 // 100  # 491 MiB on this project's hosts
    assert default_watermark(512 * GIB) == 2 * GIB
    assert default_watermark(1 * GIB) > 100 * MIB  # the kubelet evicts at memory.available<100Mi


def admitted(make_agent, **overrides):
    agent = serving(make_agent, **overrides)
    for name, tier, used in (("batch-low", "low", 600 * MIB), ("batch-low-small", "low", 50 * MIB),
                             ("batch-min", "min", 900 * MIB), ("batch-high", "high", 2 * GIB)):
        agent.admit({"name": name, "qos": "reclaimed_cores", "millicpu": 100, "tier": tier})
        agent.driver.memory[f"tidal/reclaimed/{tier}/{name}"] = used
    agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 1000})
    agent.driver.memory["tidal/shared/web"] = 8 * GIB
    return agent


def evicted(agent):
    return [(e["name"], e["cause"]) for e in agent.eviction.evictions]


def test_under_the_watermark_reclaimed_work_goes_at_once_by_tier_and_size(tmp_path, make_agent):
    agent = admitted(make_agent, memory_evict_below=1 * GIB)
    try:
        agent.eviction.memory(10.0, available_bytes=1 * GIB, total_bytes=16 * GIB, pressure_percent=None)
        assert evicted(agent) == []  # at the watermark, not under it
        # 200 MiB under: free back to twice the watermark, 1.2 GiB: both low ones, then min
        agent.eviction.memory(11.0, available_bytes=800 * MIB, total_bytes=16 * GIB, pressure_percent=None)
        assert evicted(agent) == [("batch-low", "memory"), ("batch-low-small", "memory"), ("batch-min", "memory")]
        assert agent.eviction.evictions[0]["memory_bytes"] == 600 * MIB
        assert "800 MiB" in agent.eviction.evictions[0]["reason"] and "1024 MiB watermark" in agent.eviction.evictions[0]["reason"]
        assert [a.name for a in agent.state.allocations] == ["batch-high", "web"]
        assert agent.eviction.by_cause["memory"] == 3 and agent.eviction.by_tier == {"low": 2, "min": 1, "high": 0}
        kills = [op[1] for op in agent.driver.ops if op[0] == "kill"]
        assert "tidal/shared/web" not in kills
    finally:
        agent.shutdown()


def test_the_shipped_watermark_is_the_default_one(tmp_path, make_agent):
    agent = admitted(make_agent)  # no memory_evict_below: what `tidal agent` runs with
    try:
        assert agent.eviction.watermark(16 * GIB) == default_watermark(16 * GIB)
        agent.eviction.memory(1.0, available_bytes=default_watermark(16 * GIB) + 1, total_bytes=16 * GIB,
                              pressure_percent=None)
        assert evicted(agent) == []
        agent.eviction.memory(2.0, available_bytes=default_watermark(16 * GIB) - 1, total_bytes=16 * GIB,
                              pressure_percent=None)
        assert evicted(agent)[0] == ("batch-low", "memory")
    finally:
        agent.shutdown()


def test_online_memory_pressure_evicts_one_workload_per_grace_period(tmp_path, make_agent):
    agent = admitted(make_agent, eviction_grace=5, memory_pressure_threshold=20)
    try:
        plenty = 8 * GIB
        agent.eviction.memory(10.0, plenty, 16 * GIB, pressure_percent=35.0)
        agent.eviction.memory(12.0, plenty, 16 * GIB, pressure_percent=19.9)  # a dip resets the clock
        agent.eviction.memory(13.0, plenty, 16 * GIB, pressure_percent=25.0)
        agent.eviction.memory(17.9, plenty, 16 * GIB, pressure_percent=25.0)
        assert evicted(agent) == []
        agent.eviction.memory(18.0, plenty, 16 * GIB, pressure_percent=25.0)
        assert evicted(agent) == [("batch-low", "pressure")]
        agent.eviction.memory(20.0, plenty, 16 * GIB, pressure_percent=25.0)
        assert len(agent.eviction.evictions) == 1  # the next one only after another grace period
        agent.eviction.memory(23.0, plenty, 16 * GIB, pressure_percent=25.0)
        assert evicted(agent)[-1] == ("batch-low-small", "pressure")
        agent.eviction.memory(24.0, plenty, 16 * GIB, pressure_percent=None)  # no figure: no pressure
        agent.eviction.memory(40.0, plenty, 16 * GIB, pressure_percent=25.0)
        assert len(agent.eviction.evictions) == 2
        status = agent.status()
        assert status["evictions_by_cause"] == {"cpu": 0, "memory": 0, "pressure": 2, "lending": 0}
    finally:
        agent.shutdown()


def test_pressure_eviction_off_at_zero(tmp_path, make_agent):
    agent = admitted(make_agent, eviction_grace=0, memory_pressure_threshold=0)
    try:
        for now in range(5):
            agent.eviction.memory(float(now), 8 * GIB, 16 * GIB, pressure_percent=100.0)
        assert agent.eviction.evictions == []
    finally:
        agent.shutdown()


def test_pressure_meter_reports_the_worst_cgroups_stall_share_over_the_interval():
    totals = {"tidal/shared": 0.0, "tidal/system": 0.0}

    def read(path, resource):
        assert resource == "memory"
        if path not in totals:
            return None
        return {"some": {"avg10": 1.5, "avg60": 0.0, "avg300": 0.0, "total": totals[path]},
                "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 0.0}}

    meter = PressureMeter(read, lambda: ["tidal/shared", "tidal/system", "tidal/dedicated"], "memory",
                          node=lambda resource: pytest.fail("the node's file is a fallback only"))
    assert meter.sample(100.0) is None  # the first sample has no interval
    totals["tidal/shared"] += 250_000  # 0.25 s of 2 s stalled
    totals["tidal/system"] += 1_000_000  # 1 s of 2 s
    assert meter.sample(102.0) == 50.0
    assert meter.scope == "cgroups" and meter.avg10 == 1.5
    assert meter.sample(103.0) == 0.0


def test_while_the_node_stalls_nowhere_the_online_cgroups_are_not_read():
    totals = {"tidal/shared": 0.0, "tidal/system": 0.0}
    node = {"us": 0.0}
    reads = []

    def read(path, resource):
        reads.append(path)
        return {"some": {"avg10": 0.0, "total": totals[path]}} if path in totals else None

    meter = PressureMeter(read, lambda: ["tidal/shared", "tidal/system"], "memory", gate=lambda: node["us"])
    assert meter.sample(10.0) is None and len(reads) == 2  # the first sample reads every cgroup
    reads.clear()
    assert meter.sample(10.05) == 0.0 and reads == []  # nothing anywhere stalled: no cgroup read
    assert meter.sample(10.10) == 0.0 and reads == []
    # a stall somewhere: the cgroups are read, over the interval since the last sample (not since the
    # last read: the quiet samples count)
    node["us"] += 30_000
    totals["tidal/system"] += 20_000
    assert meter.sample(10.20) == 20.0 and len(reads) == 2
    # offline alone stalls (the node moves, online does not): read, and online waited nothing
    node["us"] += 50_000
    reads.clear()
    assert meter.sample(10.30) == 0.0 and len(reads) == 2
    # no PSI at the node: every sample reads the cgroups
    node["us"] = None
    reads.clear()
    meter.sample(10.35)
    meter.sample(10.40)
    assert len(reads) == 4


def test_pressure_meter_falls_back_to_the_node_and_says_so():
    total = {"us": 0.0}
    node = lambda resource: {"some": {"avg10": 0.0, "total": total["us"]}}  # noqa: E731
    meter = PressureMeter(lambda path, resource: None, lambda: ["tidal/shared"], "memory", node=node)
    meter.sample(1.0)
    total["us"] = 100_000
    assert meter.sample(2.0) == 10.0 and meter.scope == "node"
    none = PressureMeter(lambda path, resource: None, lambda: ["tidal/shared"], node=lambda resource: None)
    assert none.sample(1.0) is None and none.sample(2.0) is None and none.scope is None


def knobs_of(specs, path):
    return next(s.knobs for s in specs if s.path == path)


def test_desired_tree_protects_online_memory_and_throttles_offline_before_its_max():
    from agent.qrm.policy import allocate
    from agent.qrm.requests import parse_request
    from agent.topology.synthetic import Shape, build_topology

    topo = build_topology(Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, threads_per_core=1))
    state = initial_state(topo, None)
    for doc in ({"name": "web", "qos": "shared_cores", "millicpu": 500},
                {"name": "default.api", "qos": "shared_cores", "millicpu": 500},
                {"name": "default.batch", "qos": "reclaimed_cores", "millicpu": 500, "tier": "low"}):
        state = state.with_allocation(allocate(topo, state, parse_request(doc)))
    api = ("kubepods/burstable/podapi", "kubepods/burstable/podapi/c1", "kubepods/burstable/podapi/c2")
    batch = ("kubepods/besteffort/podbatch", "kubepods/besteffort/podbatch/c1")
    # measured: what Tidal's online trees and each online pod use (services.protection), here the system
    # and shared trees and the online pod's own cgroup
    options = CgroupOptions(reclaimed_memory_max=10 * GIB, online_memory_low=(
        ("tidal/system", GIB), ("tidal/shared", 3 * GIB), (api[0], 3 * GIB)))
    specs = desired_tree(topo, state, pools(topo, state), options, {"cpu.idle": True, "memory": True},
                         placements={"default.api": api, "default.batch": batch})
    parent = knobs_of(specs, "tidal/reclaimed")
    assert parent["memory_max"] == 10 * GIB and parent["memory_high"] == 9 * GIB and parent["memory_soft_limit"] == 0
    # every cgroup above a measured one the sum below (a cgroup's protection is bounded by its parent's);
    # below it, where the pages are charged, each online cgroup its share ("max": one with no memory.low
    # has none, unless cgroup2 is mounted with memory_recursiveprot)
    assert knobs_of(specs, "tidal/shared")["memory_low"] == 3 * GIB
    assert knobs_of(specs, "tidal/shared/web")["memory_low"] == "max"
    assert knobs_of(specs, "tidal/system")["memory_low"] == GIB
    assert knobs_of(specs, "tidal")["memory_low"] == 4 * GIB
    assert "memory_low" not in knobs_of(specs, "tidal/dedicated")  # nothing measured there yet
    assert "memory_low" not in knobs_of(specs, "tidal/reclaimed")
    assert [knobs_of(specs, p)["memory_low"] for p in api] == [3 * GIB, "max", "max"]
    above = {s.path: s for s in specs if s.path in ("kubepods", "kubepods/burstable")}
    assert {p: s.knobs for p, s in above.items()} == {"kubepods": {"memory_low": 3 * GIB},
                                                      "kubepods/burstable": {"memory_low": 3 * GIB}}
    assert all(s.external and s.workload is None for s in above.values())  # the kubelet's: never made or removed
    order = [s.path for s in specs]
    assert order.index("kubepods") < order.index("kubepods/burstable") < order.index(api[0])
    # the reclaimed pod: throttled at the reclaimed tree's memory.high, first reclaimed under global
    # pressure (v1's soft limit), on its own cgroup (its containers' are bounded by it); never protected
    assert knobs_of(specs, batch[0])["memory_high"] == 9 * GIB and knobs_of(specs, batch[0])["memory_soft_limit"] == 0
    assert not any(k.startswith("memory") for k in knobs_of(specs, batch[1]))
    assert "kubepods/besteffort" not in order
    # an explicit memory.high wins; a kernel without the memory controller gets no memory knob at all
    explicit = desired_tree(topo, state, pools(topo, state), CgroupOptions(reclaimed_memory_max=10 * GIB,
                            reclaimed_memory_high=5 * GIB), {"cpu.idle": True, "memory": True},
                            placements={"default.batch": batch})
    assert knobs_of(explicit, "tidal/reclaimed")["memory_high"] == knobs_of(explicit, batch[0])["memory_high"] == 5 * GIB
    bare = desired_tree(topo, state, pools(topo, state), options, {"cpu.idle": True, "memory": False},
                        placements={"default.api": api, "default.batch": batch})
    assert not any(k.startswith("memory") for s in bare for k in s.knobs)
    assert "kubepods" not in [s.path for s in bare]


def test_knob_table_has_v1s_soft_limit_and_v2s_low():
    assert files_for(1, "memory_soft_limit", 0) == [("memory", "memory.soft_limit_in_bytes", "0")]
    assert files_for(2, "memory_soft_limit", 0) == []
    assert files_for(1, "memory_low", GIB) == []
    assert files_for(2, "memory_low", GIB) == [("", "memory.low", str(GIB))]
    assert files_for(2, "memory_low", "max") == [("", "memory.low", "max")]
    assert files_for(2, "memory_low", None) == [("", "memory.low", "0")]
    assert normalize("memory.soft_limit_in_bytes", "9223372036854771712") == "-1"


@pytest.mark.parametrize("value", ["12XB", "-1Gi", "", "0", "1023Ki", "1.5.2Gi"])
def test_bad_memory_watermark_is_one_line_and_a_non_zero_exit(value, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--cgroups-in-memory", "--state-dir",
                           str(tmp_path), "--socket", str(tmp_path / "s"), "--memory-evict-below", value],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--memory-evict-below" in lines[0], proc.stderr


def test_pressure_files_stay_open_and_reopen_after_a_failure(tmp_path):
    from agent.reporter.pressure import PressureFiles

    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.pressure").write_text("some avg10=1.00 avg60=0.00 avg300=0.00 total=100\n"
                                            "full avg10=0.00 avg60=0.00 avg300=0.00 total=7\n")
    files = PressureFiles(lambda path: str(tmp_path / path) if path == "cg" else None)
    assert files.read("cg", "memory")["some"]["total"] == 100
    assert files.read("elsewhere", "memory") is None
    assert files.read("cg", "cpu") is None  # no such file: nothing kept open
    assert len(files._fds) == 1
    (cgroup / "memory.pressure").unlink()
    (cgroup / "memory.pressure").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=250\n")
    assert files.read("cg", "memory")["some"]["total"] == 100  # the kept file is the one it opened
    files.close()
    assert files.read("cg", "memory")["some"]["total"] == 250  # opened afresh
    files.close()


def test_the_kept_files_of_a_cgroup_no_longer_online_are_closed(tmp_path):
    """An online pod's pressure files, kept open by the guard and the period, are closed once the pod is
    no longer among the online cgroups: kept, they would stay open for the agent's life, three per pod
    it ever saw (a node's churn of pods ran it out of descriptors)."""
    from agent.reporter.pressure import PressureFiles

    for name in ("shared", "pod-a", "pod-b"):
        (tmp_path / name).mkdir()
        for resource in ("memory", "cpu"):
            (tmp_path / name / f"{resource}.pressure").write_text("some avg10=0.00 total=5\n")
    files = PressureFiles(lambda path: str(tmp_path / path))
    online = {"paths": ["shared", "pod-a"]}
    meters = [PressureMeter(files.read, lambda: online["paths"], resource, files=files) for resource in ("memory", "cpu")]
    for meter in meters:
        meter.sample(1.0)
    assert sorted(files._fds) == [("pod-a", "cpu"), ("pod-a", "memory"), ("shared", "cpu"), ("shared", "memory")]
    online["paths"] = ["shared", "pod-b"]  # pod-a deleted, pod-b started: a new list, as online_cgroups makes
    for meter in meters:
        meter.sample(2.0)
    assert sorted(files._fds) == [("pod-b", "cpu"), ("pod-b", "memory"), ("shared", "cpu"), ("shared", "memory")]
    open_fds = len(os.listdir("/proc/self/fd"))
    for step in range(50):  # churn: each pod seen once, then gone
        online["paths"] = ["shared", f"pod-{step}"]
        (tmp_path / f"pod-{step}").mkdir()
        (tmp_path / f"pod-{step}" / "memory.pressure").write_text("some avg10=0.00 total=5\n")
        meters[0].sample(3.0 + step)
    assert len(os.listdir("/proc/self/fd")) <= open_fds
    files.close()


def test_a_gated_meter_reads_its_cgroups_again_once_its_figures_are_refresh_s_old():
    totals = {"tidal/shared": 0.0}
    reads = []

    def read(path, resource):
        reads.append(path)
        return {"some": {"avg10": 2.0, "total": totals[path]}}

    meter = PressureMeter(read, lambda: ["tidal/shared"], "cpu", gate=lambda: 7.0, refresh_s=10.0)
    meter.sample(0.0)
    assert len(reads) == 1
    for now in (1.0, 5.0, 9.9):  # the node stalled nowhere: nothing read
        assert meter.sample(now) == 0.0
    assert len(reads) == 1
    assert meter.sample(10.0) == 0.0 and len(reads) == 2  # 10 s since the last read: read, avg10 fresh
    assert meter.sample(12.0) == 0.0 and len(reads) == 2

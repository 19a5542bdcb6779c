"""cgroup isolation without touching the host: knob table, detection, desired tree,
reconciler ordering on a recording driver, v2 files on a fake unified tree, recovery."""

import os

import pytest

from agent.isolation.cgroups.desired import CgroupOptions, CgroupSpec, desired_tree
from agent.isolation.cgroups.detect import CgroupError, detect
from agent.isolation.cgroups.driver import KernelCgroups
from agent.isolation.cgroups.recording import RecordingCgroups
from agent.isolation.cgroups.knobs import files_for, normalize, shares_to_weight, weight_to_shares
from agent.isolation.cgroups.layout import kubelet_container_path, kubelet_pod_path
from agent.isolation.cgroups.reconcile import Reconciler
from agent.isolation.cgroups.recover import recover_state
from agent.qrm.policy import allocate, initial_state, pools
from agent.qrm.requests import parse_request
from agent.topology import HostFS
from agent.topology.synthetic import Shape, build_topology

TOPO = build_topology(Shape(sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=2))


def state_of(*docs, reserved=None):
    state = initial_state(TOPO, reserved)
    for doc in docs:
        decision = allocate(TOPO, state, parse_request(doc))
        state = state.with_allocation(decision)
    return state


STATE = state_of({"name": "web", "qos": "dedicated_cores", "cpus": 4, "numa_binding": True},
                 {"name": "api", "qos": "shared_cores", "millicpu": 1500},
                 {"name": "batch", "qos": "reclaimed_cores", "millicpu": 2000, "tier": "min"})


@pytest.mark.parametrize("shares,weight", [(2, 1), (1024, 39), (262144, 10000), (512, 20)],
                         ids=["min", "one-cpu", "max", "half"])
def test_shares_weight_conversion(shares, weight):
    assert shares_to_weight(shares) == weight
    assert abs(weight_to_shares(weight) - shares) <= 27  # the integer conversion rounds within one weight step


@pytest.mark.parametrize("version,knob,value,expected", [
    (1, "cpus", "0-3", [("cpuset", "cpuset.cpus", "0-3")]),
    (2, "cpus", (0, 1, 2, 3), [("", "cpuset.cpus", "0-3")]),
    (1, "cpu_shares", 1536, [("cpu", "cpu.shares", "1536")]),
    (2, "cpu_shares", 1024, [("", "cpu.weight", "39")]),
    (1, "cpu_max", (150000, 100000), [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "150000")]),
    (2, "cpu_max", (None, 100000), [("", "cpu.max", "max 100000")]),
    (1, "cpu_idle", 1, [("cpu", "cpu.idle", "1")]),
    (1, "memory_max", None, [("memory", "memory.limit_in_bytes", "-1")]),
    (2, "memory_max", 1 << 30, [("", "memory.max", "1073741824")]),
    (2, "memory_high", None, [("", "memory.high", "max")]),
    (1, "memory_high", 1 << 30, []),
    (2, "partition", "isolated", [("", "cpuset.cpus.partition", "isolated")]),
    (1, "partition", "isolated", []),
    (1, "cpu_shares", None, [("cpu", "cpu.shares", "1024")]),
    (2, "cpu_shares", None, [("", "cpu.weight", "100")]),
], ids=["v1-cpus", "v2-cpus", "v1-shares", "v2-weight", "v1-quota", "v2-max", "v1-idle", "v1-mem-none",
        "v2-mem", "v2-high-none", "v1-no-high", "v2-partition", "v1-no-partition", "v1-default-shares",
        "v2-default-weight"])
def test_knob_table(version, knob, value, expected):
    assert files_for(version, knob, value) == expected


def test_normalize():
    assert normalize("cpuset.cpus", "0,1,2,3\n") == "0-3"
    assert normalize("memory.limit_in_bytes", "9223372036854771712\n") == "-1"
    assert normalize("cpuset.cpus.partition", "member invalid\n") == "member"


def _mounts_tree(tmp_path, text, files=()):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/mounts").write_text(text)
    for path, content in files:
        full = tmp_path / path.lstrip("/")
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_text(content)
    return HostFS(str(tmp_path))


def test_detect_v1_hybrid_as_on_this_machine(tmp_path):
    fs = _mounts_tree(tmp_path, "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
                                "cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
                                "cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0\n"
                                "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n",
                      [("/sys/fs/cgroup/unified/cgroup.controllers", "\n"), ("/sys/fs/cgroup/cpu/cpu.idle", "0\n")])
    mounts = detect(fs)
    assert mounts.version == 1 and mounts.unified == "/sys/fs/cgroup/unified"
    assert mounts.mounts["cpuset"] == "/sys/fs/cgroup/cpuset" and mounts.features["cpu.idle"]


def test_detect_v2(tmp_path):
    fs = _mounts_tree(tmp_path, "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n",
                      [("/sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n"),
                       ("/sys/fs/cgroup/init.scope/cpu.idle", "0\n")])
    mounts = detect(fs)
    assert mounts.version == 2 and mounts.mount_of("cpu") == "/sys/fs/cgroup" and mounts.features["cpu.idle"]


def test_detect_nothing_usable(tmp_path):
    fs = _mounts_tree(tmp_path, "proc /proc proc rw 0 0\n")
    with pytest.raises(CgroupError, match="no usable cgroups"):
        detect(fs)


def test_detect_live_host():
    mounts = detect(HostFS("/"))
    assert mounts.version in (1, 2)


def test_desired_tree_shape():
    pool = pools(TOPO, STATE)
    specs = {s.path: s.knobs for s in desired_tree(TOPO, STATE, pool, CgroupOptions(), {"cpu.idle": True,
                                                                                       "memory": True})}
    web = STATE.get("web")
    assert specs["tidal/dedicated/web"]["cpus"] == "1-2,9-10" == ",".join(
        ["1-2", "9-10"]) and len(web.cpus) == 4
    assert specs["tidal/dedicated/web"]["mems"] == "0"
    assert specs["tidal/shared/api"]["cpu_shares"] == 1536
    assert specs["tidal/reclaimed"]["cpu_idle"] == 1
    # reclaimed work runs on the reclaim pool plus the shared pool (at idle priority), never on the
    # reserved pool nor on dedicated cpus
    from agent.topology.parse import parse_cpulist
    reclaimed = set(parse_cpulist(specs["tidal/reclaimed"]["cpus"]))
    assert reclaimed == set(pool.reclaimed) | set(pool.shared) and not reclaimed & set(pool.reserved)
    assert not reclaimed & set(web.cpus)
    # no quota of its own while it may take idle time (the parent caps the tree): written as none
    assert specs["tidal/reclaimed/min/batch"]["cpu_shares"] == 2048
    assert specs["tidal/reclaimed/min/batch"]["cpu_max"] == (None, 100_000)
    assert specs["tidal/reclaimed/min"]["cpu_shares"] == 256


def test_without_cpu_idle_reclaimed_stays_off_the_shared_pool():
    pool = pools(TOPO, STATE)
    specs = {s.path: s.knobs for s in desired_tree(TOPO, STATE, pool, CgroupOptions(), {"cpu.idle": False})}
    assert "cpu_idle" not in specs["tidal/reclaimed"] and specs["tidal/reclaimed"]["cpu_shares"] == 2
    from agent.topology.parse import format_cpulist
    assert specs["tidal/reclaimed"]["cpus"] == format_cpulist(pool.reclaimed)


def test_the_top_cgroup_weighs_least_while_it_holds_nothing_but_reclaimed_work():
    """cpu.idle is relative to siblings: at the hierarchy's top, Tidal's cgroup meets the kubelet's kubepods
    with its own weight. With the agent out of the tree (in its pod, or its systemd unit) and no workload of
    its own that is not reclaimed, that weight is reclaimed work's against the pods: the least. The default
    otherwise, and again as soon as an online workload of Tidal's own arrives."""
    from dataclasses import replace

    from agent.qrm.model import KUBERNETES

    def top(state, **options):
        specs = desired_tree(TOPO, state, pools(TOPO, state), CgroupOptions(**options), {"cpu.idle": True})
        return {s.path: s.knobs for s in specs}["tidal"]["cpu_shares"]

    batch = state_of({"name": "batch", "qos": "reclaimed_cores", "millicpu": 2000, "tier": "low"})
    pod = allocate(TOPO, batch, parse_request({"name": "web-pod", "qos": "shared_cores", "millicpu": 1000}))
    with_pod = batch.with_allocation(replace(pod, source=KUBERNETES))  # the kubelet's: in kubepods
    assert top(batch, agent_in_tree=False) == 2
    assert top(with_pod, agent_in_tree=False) == 2
    assert top(STATE, agent_in_tree=False) is None  # a shared workload of Tidal's own lives in the tree
    assert top(batch, agent_in_tree=True) is None  # the agent itself does (<base>/system)
    assert top(batch) is None  # the default: as before, where the caller does not say
    assert files_for(1, "cpu_shares", top(batch, agent_in_tree=False)) == [("cpu", "cpu.shares", "2")]
    assert files_for(2, "cpu_shares", top(batch, agent_in_tree=False)) == [("", "cpu.weight", "1")]


def test_reconciler_orders_cpuset_writes_and_writes_only_differences():
    driver = RecordingCgroups(version=1)
    rec = Reconciler(driver, "tidal")
    pool = pools(TOPO, STATE)
    specs = desired_tree(TOPO, STATE, pool, CgroupOptions(), driver.features)
    report = rec.apply(specs)
    assert report.ok and "tidal/dedicated/web" in report.created
    # a child's cpuset is never written before its parent holds those cpus
    held = {}
    for op in driver.ops:
        if op[0] == "write" and op[3] == "cpuset.cpus":
            path, text = op[1], op[4]
            from agent.topology.parse import parse_cpulist
            cpus = set(parse_cpulist(text))
            parent = path.rsplit("/", 1)[0] if "/" in path else None
            if parent in held:
                assert cpus <= held[parent], (path, text, held[parent])
            held[path] = cpus
    again = rec.apply(specs)
    assert again.written == [] and again.created == []
    # move cpus: release web, grow the shared pool; the old child is removed before its parent narrows
    state2 = STATE.without("web")
    driver.ops.clear()
    report = rec.apply(desired_tree(TOPO, state2, pools(TOPO, state2), CgroupOptions(), driver.features))
    assert report.ok and report.removed == ["tidal/dedicated/web"]
    kinds = [op[0] for op in driver.ops]
    assert kinds.index("remove") < kinds.index("write")


def test_drift_is_repaired_and_counted():
    driver = RecordingCgroups(version=1)
    rec = Reconciler(driver, "tidal")
    specs = desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), driver.features)
    rec.apply(specs)
    driver.files["tidal/dedicated/web"][("cpuset", "cpuset.cpus")] = "0-15"
    driver.files["tidal/reclaimed"][("cpu", "cpu.idle")] = "0"
    report = rec.apply(specs)
    assert sorted((p, f) for p, f, _, _ in report.repaired) == [
        ("tidal/dedicated/web", "cpuset.cpus"), ("tidal/reclaimed", "cpu.idle")]
    assert driver.files["tidal/dedicated/web"][("cpuset", "cpuset.cpus")] == "1-2,9-10"


def test_v1_quota_is_lowered_children_first_and_raised_parents_first():
    from agent.isolation.cgroups.desired import CgroupSpec

    driver = RecordingCgroups(version=1)
    rec = Reconciler(driver, "t")
    tree = lambda parent, child: [CgroupSpec("t", {"cpu_max": (parent, 100000)}),  # noqa: E731
                                  CgroupSpec("t/c", {"cpu_max": (child, 100000)})]
    rec.apply(tree(800000, 400000))
    driver.ops.clear()
    rec.apply(tree(50000, 50000))
    lowered = [op[1] for op in driver.ops if op[0] == "write" and op[3] == "cpu.cfs_quota_us"]
    assert lowered == ["t/c", "t"]  # v1 refuses a parent quota below a child's
    driver.ops.clear()
    rec.apply(tree(900000, 900000))
    raised = [(op[1], op[4]) for op in driver.ops if op[0] == "write" and op[3] == "cpu.cfs_quota_us"]
    assert raised[0] == ("t", "900000") and raised[-1] == ("t/c", "900000")


def _fake_v2_tree(root):
    """A unified hierarchy of plain files under ``root`` (a write keeps only its own text) and a driver on
    it: (the cgroup2 mount's directory, the driver)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/mounts").write_text("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n")
    cg = root / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (cg / "cgroup.subtree_control").write_text("\n")
    fs = HostFS(str(root))
    mounts = detect(fs)
    assert mounts.version == 2
    driver = KernelCgroups(mounts, fs)
    driver.features["cpu.idle"] = True
    return cg, driver


def test_v2_on_a_fake_unified_tree_writes_exact_files(tmp_path):
    cg, driver = _fake_v2_tree(tmp_path)
    rec = Reconciler(driver, "tidal")
    report = rec.apply(desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(reclaimed_memory_high=1 << 30),
                                    driver.features))
    assert report.ok, report.failed
    read = lambda rel: (cg / rel).read_text().strip()
    assert read("tidal/dedicated/web/cpuset.cpus") == "1-2,9-10"
    assert read("tidal/dedicated/web/cpuset.mems") == "0"
    assert read("tidal/dedicated/web/cpu.weight") == str(shares_to_weight(4096))
    assert read("tidal/shared/api/cpu.weight") == "59"  # 1536 shares
    assert read("tidal/reclaimed/cpu.idle") == "1"
    assert read("tidal/reclaimed/memory.max") == "max" and read("tidal/reclaimed/memory.high") == "1073741824"
    assert read("tidal/reclaimed/min/batch/cpu.weight") == str(shares_to_weight(2048))
    assert read("tidal/reclaimed/min/cpu.weight") == str(shares_to_weight(256))
    # a plain file keeps only the last of the "+cpuset", "+cpu", "+memory", "+io" writes a kernel would
    # accumulate (io: the io throttle's io.max, where the kernel offers the controller)
    assert read("cgroup.subtree_control") == "+io"


def test_recover_state_from_the_tree():
    driver = RecordingCgroups(version=1)
    rec = Reconciler(driver, "tidal")
    rec.apply(desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), driver.features))
    state = recover_state(driver, "tidal", TOPO)
    got = {(a.name, a.qos.value, a.millicpu, a.cpus, a.mems, a.tier.value) for a in state.allocations}
    want = {(a.name, a.qos.value, a.millicpu, a.cpus, a.mems, a.tier.value) for a in STATE.allocations}
    assert got == want and state.reserved == STATE.reserved
    assert recover_state(RecordingCgroups(), "tidal", TOPO) is None


@pytest.mark.parametrize("driver,qos,uid,cid,expected", [
    ("cgroupfs", "Burstable", "1234-ab", "containerd://c0ffee", "kubepods/burstable/pod1234-ab/c0ffee"),
    ("cgroupfs", "Guaranteed", "1234-ab", "c0ffee", "kubepods/pod1234-ab/c0ffee"),
    ("systemd", "BestEffort", "1234-ab", "containerd://c0ffee",
     "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1234_ab.slice/cri-containerd-c0ffee.scope"),
    ("systemd", "Guaranteed", "1234-ab", "cri-o://beef",
     "kubepods.slice/kubepods-pod1234_ab.slice/crio-beef.scope"),
], ids=["cgroupfs-burstable", "cgroupfs-guaranteed", "systemd-besteffort-containerd", "systemd-guaranteed-crio"])
def test_kubelet_paths(driver, qos, uid, cid, expected):
    assert kubelet_container_path(driver, qos, uid, cid) == expected


def test_kubelet_paths_reject_unknowns():
    with pytest.raises(ValueError, match="cgroup driver"):
        kubelet_pod_path("openrc", "Burstable", "x")
    with pytest.raises(ValueError, match="QoS class"):
        kubelet_pod_path("systemd", "Gold", "x")


def test_dedicated_leaves_are_remote_partitions_where_the_kernel_offers_them():
    features = {"cpu.idle": True, "memory": True, "partition": True}
    specs = {s.path: s for s in desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), features)}
    web = STATE.get("web")
    dedicated = ",".join(map(str, web.cpus))
    assert specs["tidal/dedicated/web"].knobs["partition"] == "root"
    assert normalize("cpuset.cpus", specs["tidal/dedicated/web"].knobs["cpus_exclusive"]) == \
        normalize("cpuset.cpus", dedicated)
    for parent in ("tidal", "tidal/dedicated"):  # exclusive all the way down from Tidal's top cgroup
        assert normalize("cpuset.cpus", specs[parent].knobs["cpus_exclusive"]) == normalize("cpuset.cpus", dedicated)
    assert "partition" not in specs["tidal/shared/api"].knobs
    without = {s.path: s for s in desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(),
                                               {"cpu.idle": True, "memory": True})}
    assert "partition" not in without["tidal/dedicated/web"].knobs and "cpus_exclusive" not in without["tidal"].knobs
    off = {s.path: s for s in desired_tree(TOPO, STATE, pools(TOPO, STATE),
                                           CgroupOptions(dedicated_partition="none"), features)}
    assert "partition" not in off["tidal/dedicated/web"].knobs
    assert files_for(1, "partition", "root") == [] and files_for(1, "cpus_exclusive", "1") == []


class RefusingExclusive(RecordingCgroups):
    """A kernel that refuses exclusive cpus (someone else holds them)."""

    def write(self, controller, path, file, text):
        if file == "cpuset.cpus.exclusive" and text.strip():
            raise CgroupError(f"{path}/{file}: write {text!r} refused: Invalid argument")
        super().write(controller, path, file, text)


def test_a_refused_partition_is_a_plain_cpuset_recorded_once_never_a_failure():
    driver = RefusingExclusive(version=2, features={"cpu.idle": True, "memory": True, "partition": True})
    reconciler = Reconciler(driver, "tidal")
    specs = desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), driver.features)
    report = reconciler.apply(specs)
    assert report.ok, report.failed
    assert report.partitions_refused and "tidal" in reconciler.partition_refused
    assert driver.read("", "tidal/dedicated/web", "cpuset.cpus.partition") == "member"
    assert reconciler.partition_of("tidal/dedicated/web").startswith("member (tidal: ")
    again = reconciler.apply(specs, verify=True)  # no retry every period, no new report
    assert again.ok and not again.partitions_refused


def test_a_partition_the_kernel_marks_invalid_goes_back_to_member():
    class InvalidPartition(RecordingCgroups):
        def read(self, controller, path, file):
            value = super().read(controller, path, file)
            if file == "cpuset.cpus.partition" and value == "root":
                return "root invalid (Invalid cpu list in cpuset.cpus.exclusive)\n"
            return value

    driver = InvalidPartition(version=2, features={"cpu.idle": True, "memory": True, "partition": True})
    reconciler = Reconciler(driver, "tidal")
    report = reconciler.apply(desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), driver.features))
    assert report.ok and [p for p, _ in report.partitions_refused] == ["tidal/dedicated/web"]
    assert "Invalid cpu list" in reconciler.partition_refused["tidal/dedicated/web"]
    assert driver.read("", "tidal/dedicated/web", "cpuset.cpus.partition") == "member"


def test_pressure_files_parse():
    from agent.isolation.cgroups.driver import parse_pressure

    text = "some avg10=1.50 avg60=0.20 avg300=0.00 total=123456\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n"
    assert parse_pressure(text) == {"some": {"avg10": 1.5, "avg60": 0.2, "avg300": 0.0, "total": 123456.0},
                                    "full": {"avg10": 0.0, "avg60": 0.0, "avg300": 0.0, "total": 7.0}}
    assert parse_pressure("some avg10=x") is None and parse_pressure("") is None


class InheritingCpusets(RecordingCgroups):
    """v2 cpusets as the kernel keeps them: empty means the parent's effective set, and a populated
    cgroup refuses empty (ENOSPC)."""

    def read(self, controller, path, file):
        if file.endswith(".effective"):
            own = (super().read(controller, path, file[:-len(".effective")]) or "").strip()
            if own:
                return own
            return self.read(controller, path.rsplit("/", 1)[0] if "/" in path else "", file)
        return super().read(controller, path, file)

    def write(self, controller, path, file, text):
        if file in ("cpuset.cpus", "cpuset.mems") and not text.strip() and self.members.get(path):
            raise CgroupError(f"{path}/{file}: write '' refused: No space left on device")
        super().write(controller, path, file, text)


def test_revert_gives_a_kubelet_container_back_what_it_inherited_not_its_narrowed_set():
    """The container's cpuset is empty (as its pod); Tidal narrows the pod first, so the container's
    effective set is already narrow when its own file is written. Revert restores the pod, then gives
    the populated container (which refuses empty) the pod's restored set."""
    driver = InheritingCpusets(version=2)
    driver.files[""][("", "cpuset.cpus")] = "0-15"
    for path in ("kubepods", "kubepods/pod1", "kubepods/pod1/c1"):
        driver.create(path)
        driver.files[path][("", "cpuset.cpus")] = ""
    driver.members["kubepods/pod1/c1"] = [42]
    reconciler = Reconciler(driver, "tidal")
    specs = [CgroupSpec(path, {"cpus": "2-3"}, "default.pod", external=True)
             for path in ("kubepods/pod1", "kubepods/pod1/c1")]
    assert reconciler.apply(specs).ok
    assert driver.read("", "kubepods/pod1/c1", "cpuset.cpus.effective") == "2-3"
    report = reconciler.revert()
    assert report.ok, report.failed
    assert driver.read("", "kubepods/pod1", "cpuset.cpus") == ""  # unpopulated: empty again
    assert driver.read("", "kubepods/pod1/c1", "cpuset.cpus") == "0-15"  # what empty would give it


def _limited_tree(tmp_path, version):
    """A fake hierarchy where Tidal's parent is ``/box/agent`` and ``/box`` carries a 512 MiB limit."""
    mib = 1 << 20
    (tmp_path / "proc/self").mkdir(parents=True)
    if version == 2:
        (tmp_path / "proc/self/mounts").write_text("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n")
        mount = tmp_path / "sys/fs/cgroup"
        names = ("memory.max", "memory.current", "inactive_file", "max")
    else:
        (tmp_path / "proc/self/mounts").write_text(
            "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n"
            "cgroup /sys/fs/cgroup/cpuset cgroup rw,cpuset 0 0\n")
        mount = tmp_path / "sys/fs/cgroup/memory"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", "9223372036854771712")
    (mount / "box/agent").mkdir(parents=True)
    (mount / "cgroup.controllers").write_text("cpuset cpu memory\n")
    for directory, limit in ((mount, names[3]), (mount / "box", str(512 * mib)), (mount / "box/agent", names[3])):
        (directory / names[0]).write_text(limit + "\n")
        (directory / names[1]).write_text(str(300 * mib) + "\n")
        (directory / "memory.stat").write_text(f"anon 1\n{names[2]} {50 * mib}\nfile 9\n")
    fs = HostFS(str(tmp_path))
    return KernelCgroups(detect(fs), fs, parent="/box/agent"), mount


@pytest.mark.parametrize("version", [1, 2])
def test_memory_ceiling_is_the_tightest_limit_above_the_tree(tmp_path, version):
    mib = 1 << 20
    driver, mount = _limited_tree(tmp_path, version)
    # the limit on /box, and what it leaves: 512 - (300 used - 50 inactive page cache) MiB
    assert driver.memory_ceiling() == (512 * mib, 262 * mib)
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    (mount / "box/agent" / name).write_text(str(400 * mib))  # a tighter limit below it wins
    assert driver.memory_ceiling() == (400 * mib, 150 * mib)


@pytest.mark.parametrize("version", [1, 2])
def test_no_memory_ceiling_without_a_limit(tmp_path, version):
    driver, mount = _limited_tree(tmp_path, version)
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    (mount / "box" / name).write_text("max\n" if version == 2 else "9223372036854771712\n")
    assert driver.memory_ceiling() is None
    (mount / "box" / name).write_text("garbage\n")  # an odd file is no limit, not an error
    assert driver.memory_ceiling() is None


def test_a_system_cores_pod_is_written_where_the_kubelet_put_it_and_a_local_one_shares_tidal_system():
    """Found on a real kubelet: the agent's own DaemonSet pod (system_cores) was admitted and never
    confined, because system workloads were skipped wherever they lived."""
    state = state_of({"name": "tidal-system.agent", "qos": "system_cores"}, {"name": "local-sys", "qos": "system_cores"})
    pool = pools(TOPO, state)
    pod_paths = ["kubepods/burstable/poduid", "kubepods/burstable/poduid/c0ffee"]
    specs = desired_tree(TOPO, state, pool, CgroupOptions(), {"cpu.idle": True},
                         placements={"tidal-system.agent": pod_paths})
    written = {s.path: s.knobs for s in specs}
    from agent.topology.parse import format_cpulist
    for path in pod_paths:
        assert written[path]["cpus"] == format_cpulist(pool.reserved or pool.shared), path
    assert not [p for p in written if p.endswith("local-sys")]  # a local system workload shares tidal/system


@pytest.mark.parametrize("cpu_idle", [True, False], ids=["cpu.idle", "no-cpu.idle"])
def test_a_reclaimed_pod_in_the_kubelets_cgroups_is_capped_at_the_reclaimed_capacity_at_the_lowest_priority(cpu_idle):
    state = state_of({"name": "default.batch", "qos": "reclaimed_cores", "millicpu": 500, "tier": "low"})
    options = CgroupOptions(reclaimed_cap_millicpu=700)
    paths = ["kubepods/besteffort/poduid", "kubepods/besteffort/poduid/c0ffee"]
    specs = {s.path: s.knobs for s in desired_tree(TOPO, state, pools(TOPO, state), options, {"cpu.idle": cpu_idle},
                                                   placements={"default.batch": paths})}
    for path in paths:
        assert specs[path]["cpu_max"] == specs["tidal/reclaimed"]["cpu_max"] == (70000, 100000), path
        assert (specs[path].get("cpu_idle"), specs[path].get("cpu_shares")) == ((1, None) if cpu_idle else (None, 2))


def test_under_the_systemd_driver_a_containers_scope_gets_its_cpus_and_the_pods_slice_the_rest():
    """Found by make test-systemd-kubelet: Tidal's cpu.idle and weight on a reclaimed container's
    systemd scope were undone by systemd (the runtime updating the unit) and repaired by Tidal in turn,
    3 times in 180 s. The scope keeps the cpuset (the value the runtime gave the unit too); the idleness,
    quota and memory protection go on the pod's slice only, for the whole subtree."""
    state = state_of({"name": "default.batch", "qos": "reclaimed_cores", "millicpu": 500, "tier": "low"},
                     {"name": "default.web", "qos": "shared_cores", "millicpu": 500})
    pod = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-poduid.slice"
    web = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podweb.slice"
    placements = {"default.batch": [pod, f"{pod}/cri-containerd-c0ffee.scope"],
                  "default.web": [web, f"{web}/cri-containerd-beef.scope"]}
    specs = {s.path: s.knobs for s in desired_tree(TOPO, state, pools(TOPO, state), CgroupOptions(),
                                                   {"cpu.idle": True, "memory": True}, placements=placements)}
    assert specs[pod]["cpu_idle"] == 1 and specs[pod]["cpu_max"] == specs["tidal/reclaimed"]["cpu_max"]
    for path in (f"{pod}/cri-containerd-c0ffee.scope", f"{web}/cri-containerd-beef.scope"):
        assert set(specs[path]) == {"cpus", "mems"}, (path, specs[path])
    assert specs[f"{pod}/cri-containerd-c0ffee.scope"]["cpus"] == specs[pod]["cpus"]
    # the cgroupfs driver's container cgroups are no unit: Tidal's values there as before
    flat = {s.path: s.knobs for s in desired_tree(TOPO, state, pools(TOPO, state), CgroupOptions(),
                                                  {"cpu.idle": True}, placements={
                                                      "default.batch": ["kubepods/besteffort/poduid",
                                                                        "kubepods/besteffort/poduid/c0ffee"]})}
    assert flat["kubepods/besteffort/poduid/c0ffee"]["cpu_idle"] == 1


class _CountingReads(RecordingCgroups):
    """The in-memory tree, noting each file read."""

    def __init__(self, version: int = 1) -> None:
        super().__init__(version=version)
        self.reads = []

    def read(self, controller: str, path: str, file: str):
        self.reads.append((path, file))
        return super().read(controller, path, file)


@pytest.mark.parametrize("version", [1, 2])
def test_between_verifying_passes_tidals_own_files_are_not_read_back(version):
    driver = _CountingReads(version=version)
    driver.create("kubepods/pod1")  # a pod's cgroup, the kubelet's: read every pass
    rec = Reconciler(driver, "tidal")
    pod = CgroupSpec("kubepods/pod1", {"cpus": "3-4"}, "default.pod1", external=True)

    def tree(cap):
        return desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(reclaimed_cap_millicpu=cap),
                            driver.features) + [pod]

    assert rec.apply(tree(2000), verify=False).ok  # the first pass trusts nothing: it reads what it writes
    first = len(driver.reads)
    assert first > 20
    # the reclaimed capacity moves: one quota written, and of Tidal's own files none read back
    driver.reads.clear()
    report = rec.apply(tree(1500), verify=False)
    quota = "cpu.cfs_quota_us" if version == 1 else "cpu.max"
    assert report.ok and [(p, f) for p, f, _ in report.written] == [("tidal/reclaimed", quota)], report.written
    assert {p for p, _ in driver.reads} <= {"kubepods/pod1"}, driver.reads
    assert ("kubepods/pod1", "cpuset.cpus") in driver.reads
    # someone else's change to Tidal's tree waits for the next verifying pass, which reads it all and repairs it
    cpus = ("cpuset", "cpuset.cpus") if version == 1 else ("", "cpuset.cpus")
    driver.files["tidal/dedicated/web"][cpus] = "0-15"
    assert rec.apply(tree(1000), verify=False).repaired == []
    assert driver.files["tidal/dedicated/web"][cpus] == "0-15"
    driver.reads.clear()
    report = rec.apply(tree(1000), verify=True)
    assert [(p, f) for p, f, _, _ in report.repaired] == [("tidal/dedicated/web", "cpuset.cpus")]
    assert driver.files["tidal/dedicated/web"][cpus] == "1-2,9-10"
    assert len(driver.reads) >= first


def test_a_write_that_failed_is_read_again_on_the_next_pass():
    driver = _CountingReads(version=2)
    rec = Reconciler(driver, "tidal")
    specs = desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), driver.features)
    assert rec.apply(specs).ok
    refuse = {"on": True}
    write = driver.write

    def failing(controller, path, file, text):
        if refuse["on"] and path == "tidal/reclaimed" and file == "cpu.max":
            raise CgroupError("tidal/reclaimed/cpu.max: Invalid argument")
        write(controller, path, file, text)

    driver.write = failing
    capped = desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(reclaimed_cap_millicpu=1000),
                          driver.features)
    assert not rec.apply(capped, verify=False).ok
    refuse["on"] = False
    driver.reads.clear()
    report = rec.apply(capped, verify=False)  # after a failed pass nothing is trusted: the file is read
    assert report.ok and ("tidal/reclaimed", "cpu.max") in driver.reads
    assert driver.files["tidal/reclaimed"][("", "cpu.max")] == "100000 100000"


def test_v2_controllers_given_back_once_per_parent_in_a_pass(tmp_path):
    """The drift pass looks at each parent's ``cgroup.subtree_control`` once, not once for every cgroup
    under it (200 workloads under three trees: a handful of parents, not 600 reads of each file): on a
    plain-file tree, where a write keeps only the last "+controller" (and reads back as none enabled),
    each parent is given its controllers back once in the pass, and each ``parent:controller`` is reported
    once."""
    cg, driver = _fake_v2_tree(tmp_path)
    rec = Reconciler(driver, "tidal")
    specs = desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), driver.features)
    assert rec.apply(specs).ok
    report = rec.apply(specs, verify=True)
    assert report.reenabled, "a plain file forgets all but the last controller: each parent is repaired"
    # the fake's one parent with the file is the root: each controller given back to it once, not once
    # for every cgroup of the tree
    assert sorted(report.reenabled) == [f"{cg}:{c}" for c in ("cpu", "cpuset", "io", "memory")], report.reenabled


def test_a_removal_the_kernel_refuses_is_pending_then_retried_every_pass_and_a_failure_only_after_the_grace():
    """A workload's cgroup whose killed processes are still exiting (they can be neither moved nor waited
    for): the kernel says EBUSY. Within REMOVAL_GRACE_S it is pending (no failure, tried again on the next
    pass even with the same specs); gone once the processes are; a failure only if it stays longer."""
    from agent.isolation.cgroups.reconcile import REMOVAL_GRACE_S

    now = {"t": 0.0}
    driver = RecordingCgroups(version=1)
    rec = Reconciler(driver, "tidal", clock=lambda: now["t"])
    assert rec.apply(desired_tree(TOPO, STATE, pools(TOPO, STATE), CgroupOptions(), driver.features)).ok
    driver.members["tidal/reclaimed/min/batch"] = [4242]
    move = driver.move

    def exiting(path, pid):  # the dying process: the kernel will not move it
        if pid == 4242:
            raise CgroupError(f"{path}: No such process")
        move(path, pid)

    driver.move = exiting
    gone = STATE.without("batch")
    specs = desired_tree(TOPO, gone, pools(TOPO, gone), CgroupOptions(), driver.features)
    first = rec.apply(specs, verify=False)
    assert first.ok and [p for p, _ in first.pending] == ["tidal/reclaimed/min/batch"]
    now["t"] += 1
    again = rec.apply(specs, verify=False)  # the same specs: tried again, not skipped
    assert again.ok and [p for p, _ in again.pending] == ["tidal/reclaimed/min/batch"]
    driver.members["tidal/reclaimed/min/batch"] = []  # it exited
    done = rec.apply(specs, verify=False)
    assert done.ok and not done.pending and done.removed == ["tidal/reclaimed/min/batch"]
    assert rec.apply(specs, verify=False).removed == []  # nothing more to do: the pass is skipped again
    # one that stays past the grace (a process stuck in the kernel) is a failure, with how long
    rec2_state = state_of({"name": "stuck", "qos": "reclaimed_cores", "millicpu": 1000, "tier": "low"})
    rec.apply(desired_tree(TOPO, rec2_state, pools(TOPO, rec2_state), CgroupOptions(), driver.features))
    driver.members["tidal/reclaimed/low/stuck"] = [4242]
    empty = state_of()
    specs = desired_tree(TOPO, empty, pools(TOPO, empty), CgroupOptions(), driver.features)
    assert rec.apply(specs).pending
    now["t"] += REMOVAL_GRACE_S + 1
    late = rec.apply(specs)
    assert not late.pending and [p for p, _, _ in late.failed] == ["tidal/reclaimed/low/stuck"]
    assert "for 11 s" in late.failed[0][2]
    # revert says so at once: the tree goes now or not at all
    assert [p for p, _, _ in rec.revert().failed if p == "tidal/reclaimed/low/stuck"] == ["tidal/reclaimed/low/stuck"]


def test_a_workloads_usage_is_read_through_a_file_kept_open_and_closed_once_it_is_gone(tmp_path):
    """Each workload's ``cpu.stat`` is read every usage period: through a file kept open (a pread, not an
    open, read and close), closed when the workload is forgotten, so that a node's churn of workloads does
    not accumulate descriptors."""
    from types import SimpleNamespace

    from agent.services.usage import Usage

    cg, driver = _fake_v2_tree(tmp_path)
    for name in ("a", "b"):
        (cg / "tidal/shared" / name).mkdir(parents=True)
        (cg / "tidal/shared" / name / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\n")
    owner = SimpleNamespace(topology=SimpleNamespace(online_cpus=lambda: [0]))
    usage = Usage(owner, SimpleNamespace(driver=driver, base="tidal"), SimpleNamespace())
    usage.start()

    def fds():
        return {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    assert usage._cpu_usage_ns("tidal/shared/a") == 1_500_000
    assert usage._cpu_usage_ns("tidal/shared/b") == 1_500_000
    kept = {str(cg / f"tidal/shared/{name}/cpu.stat") for name in ("a", "b")}
    assert kept <= fds()
    (cg / "tidal/shared/a/cpu.stat").write_text("usage_usec 2500\n")  # the same file, new content
    assert usage._cpu_usage_ns("tidal/shared/a") == 2_500_000
    usage.forget(["tidal/shared/b"])  # a is gone
    assert str(cg / "tidal/shared/a/cpu.stat") not in fds() and str(cg / "tidal/shared/b/cpu.stat") in fds()
    usage.forget([])
    assert not kept & fds()

"""--confine-host-cgroups (a host without systemd): the host's own cgroups held on the system cpus
through the Reconciler, put back as found. The kernel's side is tests/privileged/test_host_cgroups_real.py."""

import pytest

from agent.errors import TidalError
from agent.isolation.cgroups.desired import CgroupOptions, desired_tree
from agent.isolation.cgroups.recording import RecordingCgroups
from agent.isolation.cgroups.reconcile import Reconciler
from agent.qrm.policy import initial_state, pools
from agent.topology.synthetic import Shape, build_topology
from agent.cli.daemon import parse_host_cgroups

TOPO = build_topology(Shape(sockets=1, numa_per_socket=1, cores_per_numa=4, threads_per_core=1))
STATE = initial_state(TOPO, (0,))
CPUSET = ("cpuset", "cpuset.cpus")


def host_driver():
    driver = RecordingCgroups(version=1)
    for path, cpus in (("system", "0-3"), ("system/sshd", "0-3"), ("system/cron", "2-3"), ("other", "0-3")):
        driver.files[path] = {CPUSET: cpus}
        driver.members[path] = []
    return driver


def tree(options):
    return desired_tree(TOPO, STATE, pools(TOPO, STATE), options, {"cpu.idle": True, "memory": True})


def test_held_cgroups_are_external_specs_on_the_system_cpus_after_tidals_own():
    specs = tree(CgroupOptions(host_cgroups=("system", "system/sshd")))
    held = [(s.path, s.knobs, s.external) for s in specs if s.path.startswith("system")]
    assert held == [("system", {"cpus": "0"}, True), ("system/sshd", {"cpus": "0"}, True)]
    assert not [s for s in tree(CgroupOptions()) if s.path.startswith("system")]


def test_v1_children_are_narrowed_before_their_parent_and_revert_widens_the_parent_first():
    driver = host_driver()
    rec = Reconciler(driver, "tidal")
    report = rec.apply(tree(CgroupOptions(host_cgroups=("system", "system/cron", "system/sshd"))))
    assert report.ok, report.failed
    assert {p: driver.files[p][CPUSET] for p in ("system", "system/sshd", "system/cron", "other")} == {
        "system": "0", "system/sshd": "0", "system/cron": "0", "other": "0-3"}
    writes = [op[1] for op in driver.ops if op[0] == "write" and op[1].startswith("system") and op[3] == "cpuset.cpus"]
    assert writes.index("system/sshd") < writes.index("system") and writes.index("system/cron") < writes.index("system")
    assert "system" not in report.created  # never made or removed by Tidal
    driver.ops.clear()
    back = rec.revert()
    assert back.ok, back.failed
    assert {p: driver.files[p][CPUSET] for p in ("system", "system/sshd", "system/cron")} == {
        "system": "0-3", "system/sshd": "0-3", "system/cron": "2-3"}
    writes = [op[1] for op in driver.ops if op[0] == "write" and op[1].startswith("system")]
    assert writes.index("system") < writes.index("system/sshd")
    assert "system" in driver.files  # still there


def test_someone_widening_a_held_cgroup_is_repaired_on_the_next_pass():
    driver = host_driver()
    rec = Reconciler(driver, "tidal")
    specs = tree(CgroupOptions(host_cgroups=("system",)))
    assert rec.apply(specs).ok
    driver.files["system"][CPUSET] = "0-3"
    report = rec.apply(specs)
    assert report.ok and driver.files["system"][CPUSET] == "0"


@pytest.mark.parametrize("paths,offline,parent,error", [
    (("/kubepods/burstable",), (), "/", "the kubelet's pods"),
    (("/tidal/x",), (), "/", "inside Tidal's own tree"),
    (("/yarn",), ("/yarn",), "/", "declared offline"),
    (("/system", "/system/sshd"), (), "/", "below system"),
    (("/system",), (), "self", "from the hierarchy's root"),
    (("/a/../b",), (), "/", "expected a cgroup path"),
    (("/",), (), "/", "expected a cgroup path"),
    (("/system", "system"), (), "/", "given twice"),
])
def test_paths_that_are_not_the_hosts_own_work_are_one_line(paths, offline, parent, error):
    with pytest.raises(TidalError, match=error):
        parse_host_cgroups(paths, "tidal", offline, parent)


def test_paths_are_kept_from_the_root_without_slashes():
    assert parse_host_cgroups(("/system", "docker/"), "tidal", (), "/") == ("system", "docker")
    assert parse_host_cgroups((), "tidal", (), "self") == ()

"""Reclaimed work that runs in the kernel is kept off online's idle cpus: the rule, and the cpusets it makes."""

from agent.isolation.cgroups.desired import CgroupOptions, desired_tree
from agent.qrm.model import Pools
from agent.qrm.policy import allocate, initial_state
from agent.qrm.requests import parse_request
from agent.topology.synthetic import Shape, build_topology
from agent.services.kernel_work import KERNEL_SHARE, MIN_KERNEL_MILLICPU, PROBATION_PERIODS, RELEASE_PERIODS, KernelWork

MS = 1_000_000  # ns


def test_a_workload_mostly_in_the_kernel_is_confined_and_released_after_quiet_periods():
    work = KernelWork()
    assert not work.observe(0.0, {"scan": (0, 0), "spin": (0, 0), "gone": None})  # the first sample: no rate
    # a second later: scan 5 ms user + 20 ms kernel (80%), spin 900 ms user + 10 ms kernel (1%)
    assert work.observe(1.0, {"scan": (5 * MS, 20 * MS), "spin": (900 * MS, 10 * MS)})
    assert work.names() == {"scan"} and work.kernel_millicpu == {"scan": 20, "spin": 10}
    assert work.confinements == 1
    quiet = (5 * MS, 20 * MS)
    for period in range(2, RELEASE_PERIODS + 1):  # asleep: no kernel time
        # the set changes once: spin's probation ends (scan stays confined)
        # (the first sample at 0 s was its first period known)
        assert work.observe(float(period), {"scan": quiet, "spin": (900 * MS * period, 10 * MS)}) == \
            (period == PROBATION_PERIODS - 1)
        assert work.confined_of(["scan", "spin"]) == ({"scan", "spin"} if period < PROBATION_PERIODS - 1 else {"scan"})
    assert work.observe(float(RELEASE_PERIODS + 1), {"scan": quiet}) and work.names() == frozenset()


def test_the_marks_are_a_share_and_a_floor():
    work = KernelWork()
    work.observe(0.0, {"light": (0, 0), "split": (0, 0)})
    below = MIN_KERNEL_MILLICPU - 1  # all of it in the kernel, but next to nothing
    kernel = 100
    user = int(kernel * (1 - KERNEL_SHARE) / KERNEL_SHARE) + 5  # just under the share
    assert not work.observe(1.0, {"light": (0, below * MS), "split": (user * MS, kernel * MS)})
    assert work.names() == frozenset()


def test_a_new_workload_is_on_probation_for_its_first_periods():
    work = KernelWork()
    assert work.confined_of(["spin"]) == {"spin"}  # never seen
    for period in range(PROBATION_PERIODS - 1):
        assert not work.observe(float(period), {"spin": (900 * MS * period, 0)})
        assert work.confined_of(["spin"]) == {"spin"}
    assert work.observe(float(PROBATION_PERIODS), {"spin": (900 * MS * PROBATION_PERIODS, 0)})  # probation over
    assert work.confined_of(["spin"]) == frozenset() and work.confinements == 0
    # a workload whose cpu times cannot be read (a pod the kubelet has not made yet) is on probation as long
    unread = KernelWork()
    for period in range(PROBATION_PERIODS):
        unread.observe(float(period), {"pod": None})
    assert unread.confined_of(["pod"]) == frozenset()


def test_an_ended_workload_is_dropped():
    work = KernelWork()
    work.observe(0.0, {"scan": (0, 0)})
    work.observe(1.0, {"scan": (0, 50 * MS)})
    assert work.observe(2.0, {}) and work.names() == frozenset()


def test_a_confined_workload_leaves_the_shared_cpus_and_never_takes_the_reserved():
    # 16 cpus: 0-1 reserved, the rest shared; nothing lent, then 14-15 lent
    topo = build_topology(Shape(sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=2))
    state = initial_state(topo, (0, 1))
    for doc in ({"name": "scan", "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"},
                {"name": "spin", "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"}):
        state = state.with_allocation(allocate(topo, state, parse_request(doc)))
    features = {"cpu.idle": True, "memory": True}
    options = CgroupOptions(confined=frozenset({"scan"}))
    unlent = Pools(reserved=(0, 1), shared=tuple(range(2, 16)), reclaimed=(), dedicated=())
    specs = {s.path: s.knobs for s in desired_tree(topo, state, unlent, options, features)}
    assert specs["tidal/reclaimed/low/spin"]["cpus"] == "2-15"  # harvests every idle cpu but the reserved ones
    assert specs["tidal/reclaimed/low/spin"]["cpu_max"][0] is None
    # nothing lent: it waits on the shared pool at the minimum quota (never on the reserved cpus)
    assert specs["tidal/reclaimed/low/scan"]["cpus"] == "2-15"
    assert specs["tidal/reclaimed/low/scan"]["cpu_max"][0] == 1000
    assert specs["tidal/reclaimed"]["cpus"] == "2-15"
    lent = Pools(reserved=(0, 1), shared=tuple(range(2, 14)), reclaimed=(14, 15), dedicated=())
    specs = {s.path: s.knobs for s in desired_tree(topo, state, lent, options, features)}
    assert specs["tidal/reclaimed/low/scan"]["cpus"] == "14-15"  # the lent cpus only
    assert specs["tidal/reclaimed/low/scan"]["cpu_max"][0] is None  # and its own quota lifted
    assert specs["tidal/reclaimed/low/spin"]["cpus"] == "2-15"

"""Reclaimed work that runs in the kernel is kept off online's idle cpus: the rule, and the cpusets it makes."""

from agent.isolation.cgroups.desired import CgroupOptions, desired_tree
from agent.qrm.model import Pools
from agent.qrm.policy import allocate, initial_state
from agent.qrm.requests import parse_request
from agent.topology.synthetic import Shape, build_topology
from agent.services.kernel_work import (FIRST_HOLD_PERIODS, KERNEL_SHARE, MIN_KERNEL_MILLICPU, PROBATION_PERIODS,
                                       RELEASE_PERIODS, KernelWork)

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


def test_a_quiet_tree_is_not_read_workload_by_workload_and_its_quiet_time_never_adds_up():
    """Where the reclaimed tree spent under the floor in the kernel, none of its workloads is heavy: they
    are not read (200 workloads: a read each a period), they count as under the mark, and the next
    reading spans the whole time since the last one, so a little kernel time each quiet period is a
    rate, not a sum that looks heavy."""
    work = KernelWork()
    assert not work.quiet(0.0, (0, 0))  # the first reading: nothing to compare
    work.observe(0.0, {"scan": (0, 0), "idle": (0, 0)})
    assert work.observe(1.0, {"scan": (0, 50 * MS), "idle": (0, 0)}) and work.names() == {"scan"}
    assert not work.quiet(1.0, (0, 50 * MS))  # 50 millicpu in the kernel: each read
    just_under = MIN_KERNEL_MILLICPU - 1
    tree = 50 * MS
    for second in range(2, 62):  # a minute of the tree just under the floor
        tree += just_under * MS
        assert work.quiet(float(second), (0, tree))
        assert work.read_before("scan") and work.read_before("idle") and not work.read_before("new")
        work.observe(float(second), {"scan": None, "idle": None}, unread={"scan", "idle"})
        assert "scan" not in work.kernel_millicpu
    assert work.names() == frozenset()  # under the mark for RELEASE_PERIODS periods: released
    # read again: the minute's kernel time over the minute, not over the last second
    assert not work.quiet(62.0, (0, tree + 100 * MS))
    work.observe(62.0, {"scan": (0, 50 * MS + 61 * just_under * MS), "idle": (0, 0)})
    assert work.kernel_millicpu["scan"] < MIN_KERNEL_MILLICPU and work.names() == frozenset()
    # a workload with no reading kept is read whatever the tree did (unread names it in vain)
    fresh = KernelWork()
    fresh.observe(0.0, {"new": (0, 0)}, unread={"new"})
    assert fresh.read_before("new")


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


def test_the_agent_reads_each_reclaimed_workload_only_while_the_tree_works_in_the_kernel(make_agent):
    from agent.isolation.cgroups.recording import RecordingCgroups
    from tests.unit.test_pod_accounting import NodeSampler
    from tests.unit.test_capacity_api import TOPO

    driver = RecordingCgroups(version=2, features={"cpu.idle": True, "memory": True})
    agent = make_agent(TOPO, driver=driver, empty_grace=3600, memory_reserved_bytes=0)
    agent.usage.sampler = NodeSampler()
    names = [f"r{i}" for i in range(3)]
    for name in names:
        agent.admit({"name": name, "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"})
    leaves = [f"tidal/reclaimed/low/{name}" for name in names]

    def stat(path, system_us):
        driver.files[path][("", "cpu.stat")] = f"usage_usec {system_us}\nuser_usec 0\nsystem_usec {system_us}\n"

    reads = []
    read = driver.read
    driver.read = lambda controller, path, file: (reads.append(path) if file == "cpu.stat" else None) or \
        read(controller, path, file)
    for path in ["tidal/reclaimed", *leaves]:
        stat(path, 0)
    agent.tick(now=100.0, epoch=1e9)
    agent.tick(now=101.0, epoch=1e9 + 1)  # each workload read once: a reading to judge the next against
    assert set(leaves) <= set(reads)
    reads.clear()
    stat("tidal/reclaimed", 5_000)  # 5 ms in the kernel over a second, all workloads together: quiet
    agent.tick(now=102.0, epoch=1e9 + 2)
    assert "tidal/reclaimed" in reads and not set(leaves) & set(reads)
    reads.clear()
    stat("tidal/reclaimed", 505_000)  # 500 ms: the tree works in the kernel; each is read, r1 confined
    stat(leaves[1], 500_000)
    agent.tick(now=103.0, epoch=1e9 + 3)
    assert set(leaves) <= set(reads)
    assert agent.harvest.kernel_work.names() == {"r1"}


def test_a_confined_workloads_wait_at_the_minimum_quota_is_timed():
    work = KernelWork()
    work.wait(10.0, {"scan"})
    work.wait(11.5, {"scan", "load"})
    assert work.waiting() == {"load": 0.0, "scan": 1.5} and work.waited_seconds == 1.5
    work.wait(13.0, {"load"})  # scan got a lent cpu (or was released): its wait ends, counted to here
    assert work.waiting() == {"load": 1.5} and work.waited_seconds == 1.5 + 2 * 1.5
    work.wait(14.0, {"scan", "load"})  # a new wait starts afresh
    assert work.waiting() == {"load": 2.5, "scan": 0.0} and work.waited_seconds == 4.5 + 1.0
    work.wait(15.0, set())
    assert work.waiting() == {} and work.waited_seconds == 5.5 + 2.0


def _kernel_agent(make_agent, busy_millicpu):
    """An agent on 8 cpus (0 reserved) with one reclaimed job that goes into the kernel at 102 s (half a
    cpu of kernel time in a second) and is then quiet; online busy ``busy_millicpu`` all along."""
    from agent.isolation.cgroups.recording import RecordingCgroups
    from tests.unit.test_pod_accounting import NodeSampler
    from tests.unit.test_capacity_api import TOPO

    driver = RecordingCgroups(version=2, features={"cpu.idle": True, "memory": True})
    agent = make_agent(TOPO, driver=driver, empty_grace=3600, memory_reserved_bytes=0)
    agent.usage.sampler = NodeSampler()
    agent.usage.sampler.busy = busy_millicpu
    agent.admit({"name": "job", "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"})

    def stat(system_us):
        for path in ("tidal/reclaimed", "tidal/reclaimed/low/job"):
            driver.files[path][("", "cpu.stat")] = f"usage_usec {system_us}\nuser_usec 0\nsystem_usec {system_us}\n"

    stat(0)
    agent.tick(now=100.0, epoch=1e9)
    agent.tick(now=101.0, epoch=1e9 + 1)
    stat(500_000)
    agent.tick(now=102.0, epoch=1e9 + 2)
    assert agent.harvest.kernel_work.names() == {"job"}
    return agent


def test_the_agent_times_a_confined_workloads_wait_where_nothing_is_lent(make_agent):
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from agent.cli.render import status_lines
    from agent.reporter.metrics import AgentCollector

    agent = _kernel_agent(make_agent, busy_millicpu=7000)  # online uses every shared cpu: nothing to lend
    assert agent.owner.pools().reclaimed == ()
    agent.tick(now=104.0, epoch=1e9 + 4)  # at the minimum quota: nothing in the kernel any more, still held
    kernel = agent.status()["kernel_work"]
    assert kernel["confined"] == ["job"] and kernel["waiting_seconds"] == {"job": 2.0}
    assert kernel["waited_seconds_total"] == 2.0
    assert "job (- millicpu in the kernel; nothing lent: waiting at the minimum quota for 2 s)" in \
        "\n".join(status_lines(agent.status()))
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    text = generate_latest(registry).decode()
    assert "tidal_reclaimed_waiting_workloads 1.0" in text and "tidal_reclaimed_kernel_wait_seconds_total 2.0" in text


def test_a_confined_workload_on_lent_cpus_does_not_wait(make_agent):
    agent = _kernel_agent(make_agent, busy_millicpu=0)  # an idle node: cpus lent, the job runs there
    agent.tick(now=104.0, epoch=1e9 + 4)
    assert agent.owner.pools().reclaimed
    kernel = agent.status()["kernel_work"]
    assert kernel["confined"] == ["job"] and kernel["waiting_seconds"] == {} and kernel["waited_seconds_total"] == 0


class _Job:
    """One reclaimed workload's cumulative times, a period at a time: ``heavy`` (half a cpu in the kernel)
    or quiet (waiting at the minimum quota: nothing)."""

    def __init__(self, work: KernelWork) -> None:
        self.work, self.t, self.kernel = work, 0.0, 0
        work.observe(0.0, {"jvm": (0, 0)})

    def period(self, heavy: bool, lent: bool = False) -> bool:
        """whether it is confined after the period"""
        self.t += 1.0
        self.kernel += 500 * MS if heavy else 0
        self.work.observe(self.t, {"jvm": (0, self.kernel)}, lent=lent)
        return self.work.names() == {"jvm"}

    def confined_for(self, heavy_first: bool = True, lent: bool = False, limit: int = 1000) -> int:
        """periods confined: one heavy period, then quiet ones until released"""
        assert self.period(heavy_first, lent)
        for n in range(1, limit):
            if not self.period(False, lent):
                return n
        raise AssertionError("never released")


def test_a_waiting_workloads_hold_starts_short_and_doubles_each_time_it_is_confined_again():
    """Nothing lent: a JVM's start runs in the kernel for a few periods; each release lets it on for a
    period, and it is held again for twice as long, never longer than RELEASE_PERIODS"""
    job = _Job(KernelWork())
    holds = [job.confined_for() for _ in range(6)]
    expected = [min(FIRST_HOLD_PERIODS * 2 ** i, RELEASE_PERIODS) for i in range(6)]
    assert holds == expected and expected[0] < RELEASE_PERIODS and expected[-1] == RELEASE_PERIODS
    assert job.work.confinements == 6


def test_the_hold_starts_over_only_after_the_workload_ran_free_for_a_whole_release():
    job = _Job(KernelWork())
    assert job.confined_for() == FIRST_HOLD_PERIODS
    for _ in range(RELEASE_PERIODS - 1):  # free, but not long enough
        assert not job.period(False)
    assert job.confined_for() == 2 * FIRST_HOLD_PERIODS
    for _ in range(RELEASE_PERIODS):  # a whole release free: the next kernel phase is a new one
        job.period(False)
    assert job.confined_for() == FIRST_HOLD_PERIODS


def test_with_lent_cpus_a_confined_workload_stays_for_the_whole_release():
    """on lent cpus it runs at full speed: no hurry to move it back (each move costs it its cache)"""
    job = _Job(KernelWork())
    assert job.confined_for(lent=True) == RELEASE_PERIODS
    # the node's cpus taken back while it is confined: from then on its hold counts
    assert job.period(True, lent=True)
    for _ in range(FIRST_HOLD_PERIODS * 2 - 1):  # its second confinement: a hold of twice the first
        assert job.period(False, lent=True)
    assert not job.period(False, lent=False)


"""The memory throttle: cut on online memory pressure, grown back slowly; and what the agent makes of it
(the reclaimed tree's memory.high on v2, its hard limit on v1, the reported capacity)."""

import time

from agent.services.harvest import LIMIT_BAND
from agent.services.memory_throttle import FLOOR, QUIET_PERIODS, STEP, MemoryThrottle
from tests.unit.test_capacity_api import serving

MIB = 1 << 20
GIB = 1 << 30


def test_a_pressure_step_cuts_offline_to_a_share_of_what_it_holds():
    throttle = MemoryThrottle(20.0)
    assert not throttle.on_pressure(19.9, 4 * GIB) and throttle.limit is None  # under the threshold
    assert not throttle.on_pressure(None, 4 * GIB)  # no PSI figure
    assert not throttle.on_pressure(50.0, 0)  # offline holds nothing: nothing to cut
    assert throttle.on_pressure(20.0, 4 * GIB)
    assert throttle.limit == int(4 * GIB * 0.9) // MIB * MIB
    assert not throttle.on_pressure(40.0, 4 * GIB)  # offline has not shrunk under the cut yet: no new cut
    assert throttle.on_pressure(40.0, throttle.limit - MIB)  # it did, and online still stalls: cut again
    assert throttle.cuts == 2
    assert throttle.apply(10 * GIB) == throttle.limit and throttle.apply(MIB) == MIB
    small = MemoryThrottle(20.0)
    small.on_pressure(90.0, 10 * MIB)
    assert small.limit == FLOOR  # never under the floor


def test_the_throttle_grows_back_only_after_quiet_periods():
    throttle = MemoryThrottle(20.0)
    throttle.on_pressure(30.0, 2 * GIB)
    cut = throttle.limit
    for _ in range(QUIET_PERIODS - 1):
        assert not throttle.on_period(5.0, 8 * GIB)
    assert not throttle.on_period(10.0, 8 * GIB)  # half the threshold is not quiet: the count starts over
    for _ in range(QUIET_PERIODS - 1):
        assert not throttle.on_period(None, 8 * GIB)
    assert throttle.on_period(0.0, 8 * GIB) and throttle.limit == cut + STEP
    while throttle.limit is not None:
        throttle.on_period(0.0, 8 * GIB)
    assert throttle.apply(8 * GIB) == 8 * GIB  # gone once it reaches the unthrottled value


def test_off_at_zero():
    throttle = MemoryThrottle(0.0)
    assert not throttle.on_pressure(100.0, 8 * GIB) and throttle.limit is None


def throttled_agent(make_agent, version):
    agent = serving(make_agent, memory_pressure_threshold=20.0)
    agent.harvest.estimator.window_s = 300.0  # the shipped window: the throttle's own estimate (now) sees the samples
    agent.driver.version = version
    agent.driver.memory[f"{agent.config.cgroup_base}/reclaimed"] = 6 * GIB
    # the node's memory as a fixed figure, not this host's /proc/meminfo: a unit test's figures must not
    # move with what else runs on the machine
    agent.usage.memory_view = lambda: (24 * GIB, 20 * GIB)
    # on the clock throttle_now reads: with samples gone stale, the kernel's limit would lose the buffer on
    # online's measured peak (it is added only where that peak is measured), whatever the throttle does
    now = time.monotonic()
    agent.tick(now=now - 1.0)
    agent.tick(now=now)
    return agent


def test_v2_throttles_memory_high_and_keeps_the_max(tmp_path, make_agent):
    agent = throttled_agent(make_agent, 2)
    try:
        cap, top, high = agent.harvest.limits()
        assert high is None and top >= 6 * GIB  # not throttled: the default memory.high (a share of the max)
        before = agent.capacity_doc()
        assert agent.harvest.guard.throttle_now(35.0)
        cap, top_now, high = agent.harvest.limits()
        # the max is the estimate's, not the throttle's: a change of memory.high brings the held max to the
        # estimate now (it moved within LIMIT_BAND since the first tick), never down to the cut
        assert top_now == max(agent.harvest.raw_memory, 64 * MIB) // MIB * MIB
        assert abs(top_now - top) <= top * LIMIT_BAND and high == int(6 * GIB * 0.9) // MIB * MIB < top_now
        files = agent.driver.files[f"{agent.config.cgroup_base}/reclaimed"]  # written at once, not next period
        assert files[("", "memory.high")] == str(high) and files[("", "memory.max")] == str(top_now)
        after = agent.capacity_doc()
        assert after["reclaimed"]["memory_bytes"] <= high < before["reclaimed"]["memory_bytes"]
        assert after["generation"] > before["generation"]  # offline schedulers hear of it at once
        status = agent.status()
        assert status["memory"]["offline_throttled_to_bytes"] == high and status["counters"]["pressure_throttles"] == 1
        assert not agent.harvest.guard.throttle_now(35.0)  # nothing shrank yet: no second cut
    finally:
        agent.shutdown()


def test_v1_throttles_the_reported_capacity_not_the_hard_limit(tmp_path, make_agent):
    # v1 refuses (EBUSY) a hard limit under what the group holds when it cannot reclaim it
    agent = throttled_agent(make_agent, 1)
    try:
        before = agent.capacity_doc()["reclaimed"]["memory_bytes"]
        limits = agent.harvest.limits()
        assert agent.harvest.guard.throttle_now(35.0)
        assert agent.harvest.limits() == limits
        assert agent.capacity_doc()["reclaimed"]["memory_bytes"] <= agent.harvest.throttle.limit < before
    finally:
        agent.shutdown()


def test_nothing_is_cut_once_the_agent_stops(tmp_path, make_agent):
    # the guard's writes after a stop would make the tree again after --revert removed it
    import threading

    agent = throttled_agent(make_agent, 2)
    try:
        stop = threading.Event()
        agent.harvest.guard.start(stop)
        stop.set()
        writes = len(agent.driver.ops)
        assert not agent.harvest.guard.throttle_now(35.0) and agent.harvest.throttle.limit is None
        agent.harvest.guard.shrink_now(10_000)
        assert len(agent.driver.ops) == writes and agent.counters["fast_shrinks"] == 0
    finally:
        agent.shutdown()


def test_the_kernels_limits_hold_still_while_the_estimate_wanders_within_the_band(tmp_path, make_agent):
    from agent.services.harvest import LIMIT_BAND, LIMIT_FLOOR_BYTES, LIMIT_FLOOR_MILLICPU

    agent = serving(make_agent)
    try:
        now = [(4000, 8 * GIB, None)]
        agent.harvest._limits = lambda: now[0]
        assert agent.harvest.limits() == (4000, 8 * GIB, None)
        agent.reconcile()  # written
        passes = agent.counters["reconciles"]
        for cap, top in ((4000 + LIMIT_FLOOR_MILLICPU, 8 * GIB - LIMIT_FLOOR_BYTES), (4080, 8 * GIB + 160 * MIB)):
            now[0] = (cap, top, None)  # within the floor, then within 2% (80 millicpu, 164 MiB)
            assert agent.harvest.limits() == (4000, 8 * GIB, None)
            agent.reconcile()
        assert agent.counters["reconciles"] == passes  # nothing to write: no pass over the tree
        now[0] = (4000 - int(4000 * LIMIT_BAND) - 1, 8 * GIB, None)  # past the band: followed at once
        assert agent.harvest.limits() == now[0]
        now[0] = (now[0][0], now[0][1], 6 * GIB)  # the throttle moved: followed at once whatever the rest did
        assert agent.harvest.limits() == now[0]
        agent.reconcile()
        assert agent.counters["reconciles"] == passes + 1
    finally:
        agent.shutdown()

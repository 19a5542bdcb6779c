"""Online's cpu pressure takes lent cpus back and holds lending (services.cpu_pressure), and what the agent
makes of it: the pools at once, the pool sizer's growth held, status and metrics."""

from agent.reporter.headroom import ReclaimSizer
from agent.services.cpu_pressure import HOLD_PERIODS, MAX_HOLD_PERIODS, RESET_PERIODS, CpuPressureLoop
from tests.unit.test_capacity_api import serving


def test_pressure_takes_lent_cpus_back_only_over_the_threshold_and_while_cpus_are_lent():
    loop = CpuPressureLoop(20.0)
    assert not loop.on_pressure(19.9, carved=True)
    assert not loop.on_pressure(None, carved=True)  # no PSI figure
    assert not loop.on_pressure(80.0, carved=False)  # nothing lent: nothing to take back
    assert loop.shrinks == 0 and loop.holding == 0
    assert loop.on_pressure(20.0, carved=True)
    assert loop.shrinks == 1 and loop.holding == HOLD_PERIODS
    assert not CpuPressureLoop(0.0).on_pressure(100.0, carved=True)  # off


def test_lending_is_held_after_a_shrink_and_while_pressure_stays_over_half_the_threshold():
    loop = CpuPressureLoop(20.0)
    loop.on_pressure(40.0, carved=True)
    assert [loop.may_lend_more(0.0) for _ in range(HOLD_PERIODS)] == [False] * HOLD_PERIODS
    assert not loop.may_lend_more(10.0)  # half the threshold: still held
    assert loop.may_lend_more(9.9) and loop.may_lend_more(None)
    assert CpuPressureLoop(0.0).may_lend_more(100.0)


def test_the_hold_doubles_when_pressure_returns_soon_and_starts_over_after_a_long_quiet():
    loop = CpuPressureLoop(20.0)
    holds = []
    for _ in range(5):
        loop.on_pressure(50.0, carved=True)
        holds.append(loop.holding)
        while not loop.may_lend_more(0.0):
            pass
    assert holds == [HOLD_PERIODS, 2 * HOLD_PERIODS, 4 * HOLD_PERIODS, MAX_HOLD_PERIODS, MAX_HOLD_PERIODS]
    for _ in range(RESET_PERIODS):
        loop.may_lend_more(0.0)
    loop.on_pressure(50.0, carved=True)
    assert loop.holding == HOLD_PERIODS


def test_a_held_sizer_keeps_the_shared_pool_and_still_grows_it():
    sizer = ReclaimSizer()
    assert sizer.update(0, 1, 6) == 6
    for _ in range(10):
        held = sizer.update(0, 1, 6, may_lend_more=False)
    assert held == 6  # online uses nothing, but lending is held: nothing more is lent
    sizer.force(6, 0)
    sizer._shared_target = 3
    assert sizer.update(5000, 1, 6, may_lend_more=False) == 6  # online's demand still takes cpus back


def lent(agent, start=1.0):
    now = start
    while not agent.harvest.guard.carved():
        now += 1.0
        agent.tick(now=now)
        assert now < start + 60, "the agent never lent a cpu"
    return now


def test_the_agent_takes_every_lent_cpu_back_at_once_and_holds_lending(tmp_path, make_agent):
    agent = serving(make_agent)
    try:
        now = lent(agent)
        assert agent.status()["cpu_pressure"]["threshold_percent"] == 20.0  # the shipped default
        assert agent.harvest.guard.cpu_pressure_now(35.0)
        assert not agent.harvest.guard.carved()  # in the pools now, not next period
        assert agent.counters["cpu_pressure_shrinks"] == 1 and agent.counters["fast_shrinks"] == 1
        status = agent.status()["cpu_pressure"]
        assert status["shrinks"] == 1 and status["lending_held_periods"] == HOLD_PERIODS
        assert not agent.harvest.guard.cpu_pressure_now(35.0)  # nothing lent any more: nothing to do
        for _ in range(HOLD_PERIODS - 1):
            now += 1.0
            agent.tick(now=now)
            assert not agent.harvest.guard.carved(), "lending grew during the hold"
        lent(agent, now)  # and grows back after it
        from agent.reporter.metrics import render

        text = render(agent).decode()
        assert "tidal_cpu_pressure_shrinks_total 1.0" in text
    finally:
        agent.shutdown()


def test_off_at_zero(tmp_path, make_agent):
    agent = serving(make_agent, cpu_pressure_threshold=0.0)
    try:
        lent(agent)
        assert not agent.harvest.guard.cpu_pressure_now(100.0) and agent.harvest.guard.carved()
    finally:
        agent.shutdown()


def test_only_the_online_cgroups_own_pressure_acts_never_the_nodes():
    # the node-wide figure counts reclaimed tasks queueing for idle cycles: acting on it would take lent
    # cpus back whenever offline is busy
    from agent.reporter.pressure import PressureMeter
    from agent.services.guard import online_wait

    doc = lambda total: {"some": {"total": total, "avg10": 0.0}}  # noqa: E731
    totals = {"node": 0.0}
    node_only = PressureMeter(lambda path, resource: None, lambda: ["tidal/shared"], "cpu",
                              node=lambda resource: doc(totals["node"]))
    node_only.sample(0.0)
    totals["node"] = 900_000.0  # 90% of a second
    node_only.sample(1.0)
    assert node_only.scope == "node" and node_only.percent == 90.0 and online_wait(node_only) is None
    own = {"total": 0.0}
    per_cgroup = PressureMeter(lambda path, resource: doc(own["total"]), lambda: ["tidal/shared"], "cpu")
    per_cgroup.sample(0.0)
    own["total"] = 300_000.0
    per_cgroup.sample(1.0)
    assert per_cgroup.scope == "cgroups" and online_wait(per_cgroup) == 30.0

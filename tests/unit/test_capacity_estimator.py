"""The headroom estimator on recorded usage series: a tidal day, an outage, smoothing."""

import math

from agent.reporter.capacity import MEMORY_STEP, CapacityEstimator, HourlyHistory

GIB = 1 << 30
ALLOC = (32_000, 128 * GIB)  # a 32-cpu, 128 GiB node's allocatable for offline work
DAY0 = 1_700_000_000 - (1_700_000_000 % 86400)  # a UTC midnight


def online_at(hour: float) -> int:
    """A tidal day: evening peak of 24 cpus at 20:00, night valley at 30% of it."""
    phase = math.cos((hour - 20) / 24 * 2 * math.pi)  # 1 at 20:00, -1 at 08:00
    return int(24_000 * (0.65 + 0.35 * phase))


def run_day(est, day: int, step_s: int = 60, skip=lambda hour: False):
    results = []
    for t in range(0, 86400, step_s):
        epoch = DAY0 + day * 86400 + t
        hour = t / 3600
        usage = online_at(hour)
        if not skip(hour):
            est.observe(epoch, epoch, usage, 40 * GIB)
        cap = est.estimate(epoch, epoch, ALLOC, (30_000, 60 * GIB))
        results.append((hour, usage, cap))
    return results


def test_tidal_day_never_promises_what_online_needs():
    est = CapacityEstimator(window_s=300, buffer=0.2)
    results = run_day(est, 0)
    for hour, usage, cap in results:
        assert cap.millicpu + usage * 1.2 <= ALLOC[0] + 1, (hour, usage, cap)
        assert cap.millicpu % 1000 == 0 and cap.memory_bytes % MEMORY_STEP == 0
    night = [c.millicpu for h, u, c in results if 3 <= h <= 5]
    evening = [c.millicpu for h, u, c in results if 19.5 <= h <= 20.5]
    assert min(night) >= 3 * max(evening)  # the night valley lends far more than the evening peak
    assert max(evening) <= ALLOC[0] - 24_000 * 1.2 + 1


def test_shrinks_at_once_and_grows_slowly():
    est = CapacityEstimator(window_s=60, buffer=0.2, ramp_millicpu_per_s=100, deadband_millicpu=500)
    now = 0.0
    for _ in range(120):
        est.observe(now, DAY0 + now, 2_000, GIB)
        cap = est.estimate(now, DAY0 + now, ALLOC, (0, 0))
        now += 1
    assert cap.millicpu == 29_000  # 32000 - 2400, floored to whole cores
    est.observe(now, DAY0 + now, 20_000, GIB)  # online jumps
    assert est.estimate(now, DAY0 + now, ALLOC, (0, 0)).millicpu == 8_000  # 32000 - 24000: in the same step
    caps = []
    for _ in range(400):  # online drops back; the peak leaves the window after 60 s, then the ramp applies
        now += 1
        est.observe(now, DAY0 + now, 2_000, GIB)
        caps.append(est.estimate(now, DAY0 + now, ALLOC, (0, 0)).millicpu)
    rises = [b - a for a, b in zip(caps, caps[1:])]
    assert max(rises) <= 1000  # at most the ramp (100 m/s), seen through whole-core rounding
    assert caps[-1] == 29_000 and caps[59] == 8_000


def test_deadband_ignores_small_rises():
    est = CapacityEstimator(window_s=10, buffer=0.0, deadband_millicpu=2_000, ramp_millicpu_per_s=10_000)
    est.observe(0, DAY0, 10_000, 0)
    assert est.estimate(0, DAY0, ALLOC, (0, 0)).millicpu == 22_000
    for t in range(1, 30):
        est.observe(t, DAY0 + t, 9_000, 0)  # 1000 m less online: under the dead-band
        cap = est.estimate(t, DAY0 + t, ALLOC, (0, 0))
    assert cap.millicpu == 22_000


def test_metrics_outage_falls_back_to_yesterdays_hour(tmp_path):
    history = HourlyHistory(str(tmp_path / "history.json"))
    est = CapacityEstimator(window_s=300, buffer=0.2, stale_s=10, history=history)
    run_day(est, 0)
    history.save()
    # the agent restarts on day 1 and its usage source fails from 19:00 to 21:00
    restarted = CapacityEstimator(window_s=300, buffer=0.2, stale_s=10, history=HourlyHistory(history.path))
    restarted.history.load()
    results = run_day(restarted, 1, skip=lambda hour: 19 <= hour < 21)
    outage = [(h, c) for h, u, c in results if 19.2 <= h < 21]
    assert outage and all(c.source == "yesterday" for h, c in outage)
    for h, c in outage:
        yesterday_peak = max(online_at(x / 60) for x in range(int(h) * 60, int(h) * 60 + 60))
        assert c.millicpu == (ALLOC[0] - math.ceil(yesterday_peak * 1.2)) // 1000 * 1000
        assert c.millicpu + online_at(h) * 1.2 <= ALLOC[0] + 1  # still safe at the evening peak
    after = [c for h, u, c in results if 21.2 <= h < 22]
    assert all(c.source == "usage" for c in after)


def test_no_usage_and_no_history_falls_back_to_requests():
    est = CapacityEstimator()
    cap = est.estimate(0, DAY0, ALLOC, (12_345, 10 * GIB))
    assert cap.source == "requests" and cap.millicpu == 19_000 and cap.memory_bytes == 118 * GIB


def test_history_survives_a_corrupt_file(tmp_path):
    path = tmp_path / "h.json"
    path.write_text("{not json")
    history = HourlyHistory(str(path))
    history.load()
    assert history.hours == {}
    history.record(DAY0, 5, 6)
    history.save()
    again = HourlyHistory(str(path))
    again.load()
    assert again.hours == {HourlyHistory.key(DAY0): (5, 6)}


def test_per_node_capacity_follows_each_nodes_own_usage():
    est = CapacityEstimator(window_s=60, buffer=0.2)
    numa = ((0, 16_000, 64 * GIB), (1, 16_000, 64 * GIB))
    for t in range(10):
        est.observe(t, DAY0 + t, 14_000, GIB, per_node={0: 12_000, 1: 2_000})  # node 0 is busy
    cap = est.estimate(9, DAY0 + 9, ALLOC, (0, 0), numa)
    assert cap.millicpu == 15_000  # 32000 - 16800
    nodes = {n: c for n, c, m in cap.numa}
    assert nodes == {0: 1_000, 1: 13_000}  # 16000 - 14400 -> 1000; 16000 - 2400 -> 13000
    assert sum(nodes.values()) <= cap.millicpu


def test_per_node_capacity_never_exceeds_the_node_wide_figure():
    est = CapacityEstimator(window_s=60, buffer=0.2)
    numa = ((0, 16_000, 64 * GIB), (1, 16_000, 64 * GIB))
    for t in range(10):  # per-node samples say idle, node-wide says busy (they can disagree)
        est.observe(t, DAY0 + t, 20_000, GIB, per_node={0: 0, 1: 0})
    cap = est.estimate(9, DAY0 + 9, ALLOC, (0, 0), numa)
    assert cap.millicpu == 8_000 and sum(c for n, c, m in cap.numa) <= 8_000


def test_per_node_falls_back_to_a_split_without_per_node_usage():
    est = CapacityEstimator(window_s=60, buffer=0.2)
    numa = ((0, 24_000, 64 * GIB), (1, 8_000, 64 * GIB))
    est.observe(0, DAY0, 8_000, GIB)
    cap = est.estimate(0, DAY0, ALLOC, (0, 0), numa)
    assert cap.millicpu == 22_000 and dict((n, c) for n, c, m in cap.numa) == {0: 16_000, 1: 5_000}


def test_the_kernels_memory_limit_leaves_the_buffer_out_where_online_is_measured():
    est = CapacityEstimator(window_s=300, buffer=0.2)
    for t in range(5):
        est.observe(100.0 + t, DAY0 + t, 1000, 40 * GIB)
    cap = est.estimate(105.0, DAY0 + 5, ALLOC, (30_000, 60 * GIB))
    # schedulers are told the capacity less the buffer on online's 40 GiB peak (48 GiB of demand); the kernel
    # lets offline hold up to what online's peak leaves (its own page cache fills the buffer)
    assert cap.limit_memory_bytes == ALLOC[1] - 48 * GIB and cap.memory_bytes <= cap.limit_memory_bytes
    assert cap.kernel_memory_bytes == ALLOC[1] - 40 * GIB
    # online grows: both come down at once
    est.observe(106.0, DAY0 + 6, 1000, 100 * GIB)
    cap = est.estimate(106.0, DAY0 + 6, ALLOC, (30_000, 60 * GIB))
    assert cap.limit_memory_bytes == ALLOC[1] - 120 * GIB and cap.kernel_memory_bytes == ALLOC[1] - 100 * GIB
    # no measurement (requests): no buffer known, the kernel's limit is the capacity's
    fresh = CapacityEstimator(window_s=300, buffer=0.2)
    cap = fresh.estimate(100.0, DAY0, ALLOC, (30_000, 60 * GIB))
    assert cap.source == "requests" and cap.kernel_memory_bytes == cap.limit_memory_bytes

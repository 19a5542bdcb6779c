"""bench memory-isolation's summary of a treatment's rounds: pooled percentiles, each round's p99, the
harvest over whole rounds and over their settled halves, and the spread of online alone's rounds."""

from agent.bench import memory_isolation

MIB = 1 << 20


def round_of(latencies, offline=None, left=None, settled=None):
    row = {"latencies_us": latencies, "major_faults": 0, "oom_kills": {"online": 0, "offline": 0}}
    if offline is not None:
        row.update(offline_bytes=offline * MIB, left_bytes=left * MIB)
    if settled is not None:
        row.update(offline_bytes_settled=settled[0] * MIB, left_bytes_settled=settled[1] * MIB)
    return row


def test_each_rounds_p99_is_kept_beside_the_pooled_one():
    fast = round_of([100.0] * 98 + [200.0] * 2)
    slow = round_of([100.0] * 98 + [800.0] * 2)
    summary = memory_isolation.summarize([fast, slow])
    assert summary["p99_us_by_round"] == [200.0, 800.0]
    assert summary["samples"] == 200
    assert memory_isolation.round_spread(summary) == 4.0


def test_the_spread_needs_two_rounds():
    assert memory_isolation.round_spread(memory_isolation.summarize([round_of([100.0, 200.0])])) is None


def test_the_settled_harvest_is_reported_beside_the_whole_rounds():
    rows = [round_of([1.0], offline=100, left=200, settled=(180, 200)),
            round_of([1.0], offline=140, left=200, settled=(160, 200))]
    summary = memory_isolation.summarize(rows)
    assert summary["offline_harvest"] == 0.6
    assert summary["offline_harvest_settled"] == 0.85
    assert summary["offline_mib_settled"] == 170.0


def test_a_treatment_without_an_offline_side_has_no_harvest():
    summary = memory_isolation.summarize([round_of([1.0, 2.0])])
    assert "offline_harvest" not in summary and "offline_harvest_settled" not in summary


def test_the_round_median_of_p99s_is_not_moved_by_one_noisy_round():
    quiet = [round_of([100.0] * 98 + [200.0] * 2) for _ in range(4)]
    noisy = round_of([100.0] * 90 + [5000.0] * 10)
    summary = memory_isolation.summarize(quiet + [noisy])
    assert summary["p99_us"] == 5000.0  # the pooled p99 takes the noisy round's tail
    assert summary["p99_us_round_median"] == 200.0

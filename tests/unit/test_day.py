"""``cluster.day``'s clock, record and comparison (the day itself runs on a real control plane:
tests/k8s/test_day.py)."""

import time

import pytest

from cluster.day import DayClock, DayError, DayRecord, compare, deployment
from cluster.lending import in_window, parse_window


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_the_clock_compresses_the_day_and_says_how_late_a_caller_came():
    fake = FakeTime()
    clock = DayClock(0.5, monotonic=fake.monotonic, sleep=fake.sleep, midnight=0.0)
    assert clock.wait_until(10) == 0.0 and fake.now == pytest.approx(105.0)
    assert clock.minute() == pytest.approx(10.0)
    fake.now += 2.0  # four day minutes pass unseen
    assert clock.wait_until(12) == pytest.approx(2.0)
    with pytest.raises(DayError):
        DayClock(0)


def test_the_clock_gives_the_lending_windows_the_days_time():
    clock = DayClock(0.1)
    evening = [parse_window("18:00-23:00")]
    assert in_window(evening, clock.epoch(19 * 60))
    assert not in_window(evening, clock.epoch(4 * 60))
    assert time.localtime(clock.epoch(0)).tm_hour == 0


def test_the_record_sums_what_was_lent_and_what_online_went_short_of():
    record = DayRecord(replicas=[4, 4, 6, 6], running=[4, 3, 4, 6], offline_labelled=[2, 2, 1, 0])
    summary = record.summary(cores_per_node=12)
    assert summary["lent_node_hours"] == pytest.approx(5 / 60, abs=0.01)
    assert summary["lent_core_hours"] == 1.0
    assert (summary["short_replica_minutes"], summary["minutes_short"], summary["most_short"]) == (3, 2, 2)
    assert summary["take_back_to_replicas_running_minutes"] == [] and "avg_util" not in summary


def test_the_record_says_how_long_after_each_take_back_every_replica_ran_again():
    record = DayRecord(replicas=[4, 6, 6, 6, 8, 8], running=[4, 4, 5, 6, 6, 8], offline_labelled=[1] * 6,
                       actions=["-30: lend a", "1: take back a (water level 95%)", "4: take back b (water level 97%)",
                                "5: lend c"], offline_busy=[3.0] * 6, util=[0.5, 0.5, 0.6, 0.6, 0.7, 0.7],
                       offline={"completed_by_tier": {"high": 1}})
    summary = record.summary(cores_per_node=12)
    assert summary["take_back_to_replicas_running_minutes"] == [2, 1]
    assert summary["avg_util"] == pytest.approx(0.6) and summary["offline"]["core_hours"] == 0.3
    assert summary["offline"]["completed_by_tier"] == {"high": 1}


def test_the_comparison_names_where_the_runs_part():
    got = compare([0, 1, 2, 2], [0, 1, 1, 2])
    assert got == {"real_node_minutes": 5, "predicted_node_minutes": 4, "minutes_that_differ": 1,
                   "first_differ": [2], "most_apart": 1}
    with pytest.raises(DayError):
        compare([0], [0, 0])


def test_the_online_deployment_requests_its_replicas_cores():
    body = deployment("day", 3, 2, "pause", {"tidal.io/day": "online"})
    container = body["spec"]["template"]["spec"]["containers"][0]
    assert body["spec"]["replicas"] == 3 and container["resources"]["requests"]["cpu"] == "2000m"
    assert body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 0


def test_a_warmup_is_cut_from_the_record_and_its_actions_kept():
    record = DayRecord(replicas=[1, 2, 3], running=[1, 2, 3], unschedulable=[0, 1, 0], offline_labelled=[0, 1, 2],
                       actions=["-30: lend a"])
    day = record.day(1)
    assert (day.replicas, day.unschedulable, day.offline_labelled, day.actions) == ([2, 3], [1, 0], [1, 2], ["-30: lend a"])
    assert day.summary(4)["unschedulable_replica_minutes"] == 1


def test_a_reset_clock_starts_its_first_minute_again():
    fake = FakeTime()
    clock = DayClock(1.0, monotonic=fake.monotonic, sleep=fake.sleep, midnight=0.0)
    fake.now += 30
    clock.reset()
    assert clock.minute() == 0.0 and clock.wait_until(0) == 0.0

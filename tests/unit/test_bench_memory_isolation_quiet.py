"""bench memory-isolation waits for a quiet host before each treatment (the one before must not be
measured as this one's online use)."""

import itertools

import psutil

from agent.bench import memory_isolation


def feed(monkeypatch, shares):
    """psutil's cpu_percent answers ``shares`` in turn (the first, priming call included)."""
    answers = iter(shares)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: next(answers))


def test_it_waits_for_two_calm_samples_in_a_row(monkeypatch):
    # primed, then busy, calm, busy (the calm run starts over), calm, calm
    feed(monkeypatch, [0.0, 90.0, 10.0, 60.0, 5.0, 20.0])
    assert memory_isolation.wait_for_quiet_host(interval=0.0) is not None


def test_a_host_that_stays_busy_is_waited_for_no_longer_than_the_limit(monkeypatch):
    feed(monkeypatch, itertools.chain([0.0], itertools.repeat(80.0)))
    assert memory_isolation.wait_for_quiet_host(interval=0.0, limit=0.05) is None


def test_a_share_at_the_bound_is_busy(monkeypatch):
    feed(monkeypatch, [0.0, 25.0, 25.0, 24.9, 24.9])
    assert memory_isolation.wait_for_quiet_host(interval=0.0) is not None
    feed(monkeypatch, itertools.chain([0.0], itertools.repeat(25.0)))
    assert memory_isolation.wait_for_quiet_host(interval=0.0, limit=0.05) is None

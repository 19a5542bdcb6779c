"""The API's reusable connection threads (``agent.workers``)."""

from __future__ import annotations

import threading
import time

from agent.workers import Workers


def _wait(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_finished_thread_serves_the_next_job_instead_of_a_new_one():
    ran, names = [], set()

    def work(n):
        ran.append(n)
        names.add(threading.get_ident())

    pool = Workers(work, name="t")
    for n in range(50):
        pool.submit(n)
        _wait(lambda: len(ran) == n + 1 and pool.status()["idle"] == 1)
    assert ran == list(range(50))
    assert pool.status() == {"threads": 1, "idle": 1, "started": 1}
    assert len(names) == 1


def test_jobs_at_once_get_a_thread_each_and_none_is_lost():
    gate = threading.Event()
    done = []
    lock = threading.Lock()

    def work(n):
        gate.wait(5)
        with lock:
            done.append(n)

    pool = Workers(work, name="t")
    for n in range(20):  # each blocks until the gate opens: 20 threads, none waiting for another job
        pool.submit(n)
    assert pool.status()["threads"] == 20
    gate.set()
    _wait(lambda: len(done) == 20)
    assert sorted(done) == list(range(20))
    _wait(lambda: pool.status()["idle"] == 20)
    for n in range(20, 40):  # the next burst reuses them all
        pool.submit(n)
    _wait(lambda: len(done) == 40)
    assert pool.status()["started"] == 20
    assert sorted(done) == list(range(40))


def test_an_idle_thread_ends_after_its_wait_and_a_later_job_starts_one():
    ran = []
    pool = Workers(ran.append, name="t", idle_s=0.1)
    pool.submit(1)
    _wait(lambda: pool.status()["threads"] == 0)
    assert pool.status() == {"threads": 0, "idle": 0, "started": 1}
    pool.submit(2)
    _wait(lambda: ran == [1, 2])
    assert pool.status()["started"] == 2


def test_jobs_racing_the_idle_timeout_all_run():
    """A thread whose wait ends as a job is handed to it runs the job (the job was promised)."""
    done = []
    lock = threading.Lock()

    def work(n):
        with lock:
            done.append(n)

    pool = Workers(work, name="t", idle_s=0.001)
    for n in range(2000):
        pool.submit(n)
        if n % 7 == 0:
            time.sleep(0.001)
    _wait(lambda: len(done) == 2000)
    assert sorted(done) == list(range(2000))


def test_a_failing_job_leaves_its_thread_serving(caplog):
    ran = []

    def work(n):
        ran.append(n)
        if n == 0:
            raise ValueError("boom")

    pool = Workers(work, name="t")
    pool.submit(0)
    _wait(lambda: ran == [0] and pool.status()["idle"] == 1)
    pool.submit(1)
    _wait(lambda: ran == [0, 1])
    assert pool.status()["started"] == 1
    assert "t: a job failed" in caplog.text and "boom" in caplog.text

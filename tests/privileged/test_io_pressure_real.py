"""Online's io pressure on real cgroups and a real disk.

v2 (the VM tier, its ``/var/tmp`` an ext4 loop device): offline work scans the disk online reads from; while
online reads nothing, nothing is limited; the step is online starting to read behind the scan: the fast guard
limits offline's bandwidth on that device (``io.max``) in the first window in which online waited the
threshold's share, halves it while online still waits, holds offline under it, and online then waits no more
than with offline gone; the limit grows back once online is quiet, and a clean stop lifts it. Both sides read
with ``O_DIRECT``: every read reaches the device (the page cache would hide the disk).

v1 (the host): online's io pressure is read from the online cgroups (the cgroup2 mirror) and shown, and
nothing is limited (``isolation.cgroups.blockio`` says why)."""

import os
import select
import subprocess
import sys
import threading
import time

import pytest

from agent.daemon import AgentConfig
from agent.isolation.cgroups.blockio import read_io_bytes, read_io_limits
from agent.services import io_throttle
from tests.conftest import privileged
from tests.privileged.test_memory_real import detect_version, disk_file, finish, make_agent

pytestmark = [pytest.mark.privileged, privileged]
MIB = 1 << 20

# while told "go" (until told "stop"), a 4 KiB read at a random offset every millisecond (a busy service's
# lookups), straight from the device
LOOKUPS = ("import mmap, os, random, sys, threading, time\non = threading.Event()\n"
           "def control():\n    for line in sys.stdin:\n        on.set() if line.strip() == 'go' else on.clear()\n"
           "threading.Thread(target=control, daemon=True).start()\n"
           "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\nblocks = os.fstat(fd).st_size // 4096\n"
           "buf = mmap.mmap(-1, 4096)\nrng = random.Random(1)\nwhile True:\n    on.wait()\n"
           "    os.preadv(fd, [buf], rng.randrange(blocks) * 4096)\n    time.sleep(0.001)\n")
# ready (says so) and, once told, four threads each reading 1 MiB at a time from its own quarter of the file, round and round, as
# fast as the device gives them (a batch job's parallel scan: several requests in the device's queue at once)
STREAM = ("import mmap, os, sys, threading\nfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)\n"
          "print('ready', flush=True)\nsys.stdin.readline()\n"
          "quarter = os.fstat(fd).st_size // 4\ndef scan(start):\n    buf, offset = mmap.mmap(-1, 1 << 20), 0\n"
          "    while True:\n        offset = 0 if offset >= quarter else offset + os.preadv(fd, [buf], start + offset)\n"
          "threads = [threading.Thread(target=scan, args=(i * quarter,)) for i in range(4)]\n"
          "[t.start() for t in threads]\n[t.join() for t in threads]\n")


def write_file(path, mib):
    block = os.urandom(MIB)
    with open(path, "wb") as handle:
        for _ in range(mib):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())


def ready(proc, seconds):
    """Whether ``proc`` said it is ready within ``seconds``."""
    readable, _, _ = select.select([proc.stdout], [], [], seconds)
    return bool(readable) and proc.stdout.readline().strip() == "ready"


def tell(proc, line):
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def offline_read(agent, path):
    """Bytes ``path`` has read from every device."""
    return sum(r for r, _ in (read_io_bytes(agent.driver, path) or {}).values())


def io_wait_share(agent, path, seconds):
    """The share of ``seconds`` in which some task of ``path`` waited on block io (PSI ``some``), percent."""
    before = agent.driver.pressure(path, "io")["some"]["total"]
    time.sleep(seconds)
    return (agent.driver.pressure(path, "io")["some"]["total"] - before) / (seconds * 1e6) * 100


def read_rate(agent, path, seconds):
    """Bytes per second ``path`` read from its busiest device over ``seconds``, and that device."""
    before = read_io_bytes(agent.driver, path) or {}
    time.sleep(seconds)
    after = read_io_bytes(agent.driver, path) or {}
    rates = {d: (after[d][0] - before.get(d, (0, 0))[0]) / seconds for d in after}
    device = max(rates, key=rates.get) if rates else None
    return (rates[device] if device else 0.0), device


def test_online_io_pressure_is_read_from_the_online_cgroups_and_shown(tmp_path):
    if not os.path.exists("/proc/pressure/io"):
        pytest.fail("this kernel keeps no PSI (CONFIG_PSI off or booted psi=0): the loop cannot see io pressure")
    agent = make_agent(tmp_path)
    procs = []
    try:
        agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 500})
        web = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    time.sleep(1)\n"])
        procs.append(web)
        agent.attach("web", web.pid)
        for _ in range(2):
            agent.tick()
            time.sleep(0.1)
        status = agent.status()["io_pressure"]
        assert status["scope"] == "cgroups" and 0 <= status["online_io_percent"] <= 100, status
        v2 = agent.driver.version == 2
        assert status["supported"] is v2 and status["threshold_percent"] == (20.0 if v2 else 0.0), status
        assert status["limits"] == {} and status["throttles"] == 0
    finally:
        finish(agent, procs)


def test_online_io_pressure_limits_offline_io_on_its_device(tmp_path):
    if detect_version() != 2:
        pytest.skip("io limits are cgroup v2 only (isolation.cgroups.blockio): runs in `make test-cgroup2`")
    if not os.path.exists("/proc/pressure/io"):
        pytest.fail("this kernel keeps no PSI (CONFIG_PSI off or booted psi=0): the loop cannot see io pressure")
    assert AgentConfig().io_pressure_threshold == 20.0
    agent = make_agent(tmp_path)  # the shipped threshold, period and guard interval
    base, procs, stop, ticker = agent.config.cgroup_base, [], threading.Event(), None
    files = [disk_file(tmp_path), disk_file(tmp_path)]

    def loop():  # the agent's period, as the CLI agent runs it
        while not stop.wait(agent.config.period):
            agent.tick()

    try:
        if not agent.driver.features.get("io"):
            pytest.fail("no io controller with io.max in this kernel's cgroups: nothing to limit with")
        write_file(files[0], 64)
        write_file(files[1], 256)
        agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 500})
        agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"})
        web = subprocess.Popen([sys.executable, "-c", LOOKUPS, files[0]], stdin=subprocess.PIPE, text=True)
        batch = subprocess.Popen([sys.executable, "-c", STREAM, files[1]], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        procs += [web, batch]
        agent.attach("web", web.pid)
        agent.attach("batch", batch.pid)
        leaf, reclaimed = f"{base}/shared/web", f"{base}/reclaimed"
        if agent.driver.pressure(leaf, "io") is None:
            pytest.fail(f"no io.pressure for {leaf}: the loop would fall back to the node's")
        tell(web, "go")
        ticker = threading.Thread(target=loop, daemon=True)
        ticker.start()
        agent.start_guard()
        alone = io_wait_share(agent, leaf, 2.0)
        assert agent.counters["io_pressure_throttles"] == 0, f"limited with no offline io (online waited {alone:.1f}%)"
        # offline alone: online pauses and the scan starts; once it reads and has read for a second, nothing
        # is limited: online does not wait. The scan's interpreter starts in the reclaimed tree, on what
        # online leaves: under the v2 tier's emulation that took more than 15 s once, so it says when ready
        assert ready(batch, 60), (f"the scan's interpreter did not start in 60 s: reclaimed cpu.max "
                                  f"{agent.driver.read('', reclaimed, 'cpu.max')!r}")
        tell(web, "stop")
        idle = offline_read(agent, reclaimed)
        tell(batch, "go")
        deadline = time.monotonic() + 15
        while offline_read(agent, reclaimed) <= idle:
            assert time.monotonic() < deadline, (f"the offline scan read nothing in 15 s: reclaimed cpu.max "
                                                 f"{agent.driver.read('', reclaimed, 'cpu.max')!r}")
            time.sleep(0.05)
        time.sleep(1.0)
        assert agent.counters["io_pressure_throttles"] == 0, "offline io limited while online read nothing"
        # the step: online reads again, now behind the scan's requests
        guard = agent.harvest.io_guard
        windows_before = guard.windows
        tell(web, "go")
        step = time.monotonic()
        while agent.counters["io_pressure_throttles"] == 0:
            assert time.monotonic() - step < 10, (
                f"no io limit in 10 s: online waited {agent.harvest.io_pressure.percent}% of the last period "
                f"(alone {alone:.1f}%), offline moved {agent.harvest.io_guard.rates}")
            time.sleep(0.005)
        limited_after = time.monotonic() - step
        windows, decided_after = guard.cut_window - windows_before, guard.cut_at - step
        after_step = [(n - windows_before, p, moved) for n, p, moved in guard.recent if n > windows_before]
        trigger = agent.harvest.io_guard.throttle.last_trigger
        first = dict(agent.harvest.io_guard.throttle.limits)
        in_kernel = read_io_limits(agent.driver, reclaimed)
        assert in_kernel and set(in_kernel) <= set(first), (in_kernel, first)
        device = next(iter(in_kernel))
        assert in_kernel[device][0] is not None and in_kernel[device][0] <= first[device][0]
        time.sleep(3.0)  # online still waiting: halved again each window down to what lets it be
        limit = agent.harvest.io_guard.throttle.limits[device][0]
        assert read_io_limits(agent.driver, reclaimed)[device][0] == limit
        rate, busiest = read_rate(agent, reclaimed, 2.0)
        # online's wait over 6 s each, under the limit and with the scan gone: over 3 s each the two differed
        # by -2.9 to +2.8 points in six VM runs and by +7.3 in a CI run beside the other tiers
        after = io_wait_share(agent, leaf, 6.0)
        assert web.poll() is None and batch.poll() is None  # nothing killed: online nor offline
        # the reference for what the limit leaves: online's wait with the scan gone, measured right after (in
        # the VM online's wait at the start, before any scan, reads lower than this: 0.6-3.6% against 12-27%
        # later with no offline io at all, for a reason not established; the comparison is made in the same
        # stretch of the run)
        batch.kill()
        batch.wait()
        gone = io_wait_share(agent, leaf, 6.0)
        print(f"online alone waited {alone:.1f}% on io; reading behind offline's scan {trigger}% over "
              f"{io_throttle.WINDOW_S} s, decided in the guard's window {windows} after online's step "
              f"({decided_after:.3f} s), limited in the kernel {limited_after:.3f} s after the step to "
              f"{first[device][0] / MIB:.1f} MiB/s on {device}, then {limit / MIB:.1f} MiB/s "
              f"({agent.harvest.io_guard.throttle.cuts} cuts); offline read {rate / MIB:.2f} MiB/s under it; "
              f"online waited {after:.1f}% under the limit, {gone:.1f}% with the scan gone; online's stall share "
              f"in each window from the step to the cut: {[p if p is None else round(p, 1) for n, p, _ in after_step if n <= windows]}")
        assert busiest == device
        assert rate <= limit * 1.25 + 256 * 1024, f"offline read {rate / MIB:.2f} MiB/s under a {limit / MIB:.2f} MiB/s limit"
        # the guard acts on the first window in which online waited the threshold's share while offline moved
        # data, and the limit is in the kernel soon after: the guard's wait for the state owner's lock (a period
        # may hold it) and a reconcile. (How soon after the step online's wait first reaches the threshold is
        # the load's: the emulated disk gave it within 0.8 s in nine VM runs, after 2.1 s and 3.2 s in two
        # later ones, online's share there swinging around the threshold: 14-30%.)
        crossed = [n for n, p, moved in after_step if p is not None and p >= guard.throttle.threshold and moved]
        assert crossed and crossed[0] == windows, after_step
        assert limited_after - decided_after < 1.0, (
            f"the limit reached the kernel {limited_after - decided_after:.3f} s after the guard's cut")
        # what the limit is for: online waits no more than with offline gone (5 points: see the measurements)
        assert after <= gone + 5, f"online waited {after:.1f}% under the limit, {gone:.1f}% with offline gone"
        # online quiet (its lookups stopped) and no offline io (a window with none cuts nothing): the limit
        # doubles back once per period after the quiet ones
        web.kill()
        web.wait()
        time.sleep(2 * io_throttle.WINDOW_S)
        quiet = agent.harvest.io_guard.throttle.limits[device][0]
        deadline = time.monotonic() + (io_throttle.QUIET_PERIODS + 4) * agent.config.period + 5
        seen = []
        while agent.harvest.io_guard.throttle.limits.get(device, (None, None))[0] == quiet:
            assert time.monotonic() < deadline, f"the io limit did not grow back: online waited {seen}% a period"
            if agent.harvest.io_pressure.percent not in seen[-1:]:
                seen.append(agent.harvest.io_pressure.percent)
            time.sleep(0.05)
        grown = agent.harvest.io_guard.throttle.limits.get(device, (None, None))[0]
        assert grown is None or grown == 2 * quiet
        # the period decides the new limit, then the same tick's reconcile writes it (the CI's VM read io.max
        # between the two once): the kernel has it within that tick
        deadline = time.monotonic() + agent.config.period + 2
        while read_io_limits(agent.driver, reclaimed).get(device, (None, None))[0] != grown:
            assert time.monotonic() < deadline, (
                f"io.max still {read_io_limits(agent.driver, reclaimed)} a period after the limit grew to {grown}")
            time.sleep(0.02)
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        left = {}  # what a clean stop left on the reclaimed tree (it must lift its limits)
        finish(agent, procs, after_shutdown=lambda: left.update(read_io_limits(agent.driver, f"{base}/reclaimed")))
        for path in files:
            if os.path.exists(path):
                os.unlink(path)
    assert left == {}, f"a clean stop left io limits: {left}"

"""Online's cpu pressure on real cgroups (v1 on the host, v2 in the VM tier): online work that waits on the
runqueue while its pool's use stays under saturation gets its lent cpus back from the fast guard, at the
shipped threshold, and lending stays held.

The online service is a request fanned out to its workers: a clock process writes one byte to each of
three worker processes every 40 ms, and each worker runs 7 ms of cpu per byte. 0.53 cpu on average, at most
0.62 over any 50 ms, under the utilisation guard's 90% of one cpu, so the agent lends the other cpu. On the
one cpu left after lending, the three are released within microseconds of each other (one writer, not
three timers: under emulation two processes' timers at the same instant were seen to fire milliseconds
apart, giving a stall share anywhere from 20% to 48%) and queue for it: PSI ``some`` 35-50%. The node keeps
no reserved pool (``reserved_cpus=()``): on a 2-cpu host that is the only way to have a cpu to lend (as
``bench reaction`` does)."""

import os
import subprocess
import sys
import threading
import time

import pytest

from agent.daemon import AgentConfig
from agent.topology.parse import parse_cpulist
from tests.conftest import privileged
from tests.privileged.test_memory_real import finish, make_agent

pytestmark = [pytest.mark.privileged, privileged]

WORKERS, BUSY_S, PERIOD_S = 3, 0.007, 0.040
# a worker: 7 ms of cpu time for each byte on its stdin
WORKER = ("import os, time\nwhile os.read(0, 1):\n    end = time.thread_time() + %r\n"
          "    while time.thread_time() < end:\n        pass\n" % BUSY_S)
# the clock: once told "go", one byte to every worker (the fds in argv) every 40 ms, until the workers are gone
CLOCK = ("import os, sys, time\nfds = [int(a) for a in sys.argv[1:]]\nprint('ready', flush=True)\n"
         "sys.stdin.readline()\ntry:\n    while True:\n        time.sleep(%r - time.monotonic() %% %r)\n"
         "        for fd in fds:\n            os.write(fd, b'x')\nexcept BrokenPipeError:\n    pass\n"
         % (PERIOD_S, PERIOD_S))
SPIN = "while True:\n    pass\n"


def stall_share(agent, path, seconds):
    """The share of ``seconds`` in which some task of ``path`` waited for a cpu (PSI ``some``), percent."""
    before = agent.driver.pressure(path, "cpu")["some"]["total"]
    time.sleep(seconds)
    return (agent.driver.pressure(path, "cpu")["some"]["total"] - before) / (seconds * 1e6) * 100


def test_online_cpu_pressure_takes_lent_cpus_back_under_saturation(tmp_path):
    if not os.path.exists("/proc/pressure/cpu"):
        pytest.fail("this kernel keeps no PSI (CONFIG_PSI off or booted psi=0): the loop cannot see cpu pressure")
    assert AgentConfig().cpu_pressure_threshold == 20.0
    agent = make_agent(tmp_path)  # the shipped threshold, period and guard interval
    base, procs, stop, ticker, writers = agent.config.cgroup_base, [], threading.Event(), None, []

    def loop():  # the agent's period, as the CLI agent runs it
        while not stop.wait(agent.config.period):
            agent.tick()

    try:
        agent.admit({"name": "web", "qos": "shared_cores", "millicpu": 500})
        agent.admit({"name": "batch", "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"})
        batch = subprocess.Popen([sys.executable, "-c", SPIN])
        procs.append(batch)
        agent.attach("batch", batch.pid)
        pipes = [os.pipe() for _ in range(WORKERS)]
        writers = [w for _, w in pipes]  # the test keeps them: each trial's clock gets them
        webs = [subprocess.Popen([sys.executable, "-c", WORKER], stdin=r) for r, _ in pipes]
        for r, _ in pipes:
            os.close(r)
        for web in webs:
            procs.append(web)
            agent.attach("web", web.pid)
        leaf = f"{base}/shared/web"
        if agent.driver.pressure(leaf, "cpu") is None:
            pytest.fail(f"no cpu.pressure for {leaf}: the loop would fall back to the node's")
        ticker = threading.Thread(target=loop, daemon=True)
        ticker.start()
        agent.start_guard()
        # A trial: online idle with a cpu lent, then the burst. Under emulation on a busy host the guest
        # counts a preempted vcpu's time as its task's (0.53 cpu read as 0.96 in a period): online then
        # saturates its one cpu as the guest sees it and the utilisation guard rightly takes the cpu back
        # first, which tests nothing about pressure. Such a trial is printed and the burst tried again,
        # at most three times.
        trials = []
        while True:
            # the clock started (an interpreter's start is a burst of cpu under emulation) before online idles
            clock = subprocess.Popen([sys.executable, "-c", CLOCK, *map(str, writers)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, pass_fds=writers)
            procs.append(clock)
            agent.attach("web", clock.pid)
            assert clock.stdout.readline().strip() == "ready"
            deadline, since = time.monotonic() + 90, None  # after a shrink the sizer keeps its 30 s peak
            while since is None or time.monotonic() - since < agent.config.period:  # online idle: a cpu lent
                assert time.monotonic() < deadline, f"the agent never lent a cpu for a whole period ({trials})"
                lent = agent.harvest.guard.carved() and agent.usage.online_millicpu
                since = (since or time.monotonic()) if lent else None
                time.sleep(0.02)
            assert agent.counters["cpu_pressure_shrinks"] == 0
            by_use = agent.counters["fast_shrinks"]  # the utilisation guard's so far (the VM's slow start may fire it)
            step = time.monotonic()
            clock.stdin.write("go\n")
            clock.stdin.flush()
            while True:
                with agent.harvest.owner.lock:  # a pressure shrink counts in both, under the lock
                    pressured, used = agent.counters["cpu_pressure_shrinks"], agent.counters["fast_shrinks"]
                if pressured or used != by_use:
                    break
                assert time.monotonic() - step < 10, (
                    f"no cpu taken back in 10 s: lent {agent.harvest.guard.carved()}, online waited "
                    f"{agent.harvest.cpu_pressure.percent}% of the last period; online's use by period "
                    f"{list(agent.harvest.sizer._history)[-12:]} millicpu")
                time.sleep(0.005)
            if pressured:
                break
            clock.kill()  # the workers wait for the next trial's clock
            clock.wait()
            procs.remove(clock)
            trials.append(f"utilisation first after {time.monotonic() - step:.2f} s, online's use by period "
                          f"{list(agent.harvest.sizer._history)[-4:]} millicpu")
            print(f"trial {len(trials)}: {trials[-1]}")
            assert len(trials) < 3, f"online's use read as saturation in every trial: {trials}"
        webs.append(clock)
        taken_after = time.monotonic() - step
        assert not agent.harvest.guard.carved()
        held = []
        for _ in range(5):  # periods: lending stays held
            held.append(stall_share(agent, leaf, agent.config.period))
            assert not agent.harvest.guard.carved(), "lending grew back during the hold"
        print(f"online's burst -> it waited {agent.harvest.cpu_loop.last_trigger}% of 0.25 s on the one cpu left; "
              f"lent cpu taken back {taken_after:.3f} s after the burst began (guard {agent.config.guard_interval} s, "
              f"pressure window 0.25 s); online waited "
              f"{[round(h, 1) for h in held]}% of each period after; utilisation shrinks since the burst "
              f"{agent.counters['fast_shrinks'] - agent.counters['cpu_pressure_shrinks'] - by_use}")
        # the utilisation guard did not see it: 0.5 cpu is no saturation of one cpu
        assert agent.counters["cpu_pressure_shrinks"] == 1
        assert agent.counters["fast_shrinks"] == by_use + 1
        # online's processes may run on every cpu again, as the kernel shows it (whether the scheduler spreads
        # them is its own affair: this host's kernel kept both on one cpu for seconds at times, printed above)
        for web in webs:
            with open(f"/proc/{web.pid}/status") as handle:
                line = next(x for x in handle if x.startswith("Cpus_allowed_list:"))
            assert set(parse_cpulist(line.split(":", 1)[1].strip())) == set(agent.topology.online_cpus()), line
        assert all(p.poll() is None for p in procs)  # nothing killed: online nor offline
    finally:
        for fd in writers:
            os.close(fd)
        stop.set()
        if ticker is not None:
            ticker.join()  # a period mid-way would make the tree again after the revert
        finish(agent, procs)

"""The fast guard: online gets what it needs back between the agent's periods.

Every ``guard_interval`` (50 ms by default) on a thread of its own, from a few file reads:

* online saturates its pool while cpus are lent: every lent cpu back now (``shrink_now``);
* online waits for cpus (PSI, ``services.cpu_pressure``): the same, and lending held a while;
* online stalls on memory (PSI, ``services.memory_throttle``): what offline may hold cut now, in the
  kernel and the capacity (``throttle_now``);
* online waits on block io (PSI, ``services.io_guard``): offline's io limited, through the Reconciler.

Every write goes through the Reconciler under the state owner's lock, and none after the agent began to
stop. The period (``services.harvest``) grows things back slowly; the guard only takes back, at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional

from agent.qrm.policy import _layout
from agent.reporter.capacity import MIB
from agent.reporter.pressure import PressureFiles, PressureMeter
from agent.services import io_throttle
from agent.services.cpu_pressure import WINDOW_S

log = logging.getLogger("tidal.agent")


def online_wait(meter: PressureMeter) -> Optional[float]:
    """Online's cpu (or io) wait share from the online cgroups' own pressure files, else None: the
    node-wide figure counts offline work's own waiting (reclaimed tasks queue for idle cycles by design,
    and wait on their own io), and a loop on it would act whenever offline is busy."""
    return meter.percent if meter.scope == "cgroups" else None


class FastGuard:
    def __init__(self, harvest) -> None:
        self.harvest = harvest
        self._stop: Optional[threading.Event] = None  # the agent's stop, once the guard runs

    def throttle_now(self, percent: float) -> bool:
        """Online stalls on memory: cut what offline may hold, in the kernel and the capacity, now."""
        owner = self.harvest.owner
        with owner.lock:
            if self.stopping():
                return False
            offline = self.harvest.driver.memory_usage_bytes(f"{self.harvest.enforcement.base}/reclaimed")
            if not self.harvest.throttle.on_pressure(percent, offline):
                return False
            log.info("online memory pressure %.1f%%: offline memory throttled to %d MiB (it held %d MiB)",
                     percent, self.harvest.throttle.limit // MIB, offline // MIB)
            owner.commit(self.harvest.with_capacity(owner.state))
            self.harvest.enforcement.reconcile()
            # counted once in the kernel (as every count of the guard's: a reader finds what it counts)
            self.harvest.counters["pressure_throttles"] = self.harvest.counters.get("pressure_throttles", 0) + 1
            return True

    def start(self, stop: threading.Event) -> None:
        if self.harvest.config.guard_interval <= 0 or self.harvest.config.cgroups_in_memory or not self.harvest.config.resize:
            return
        self._stop = stop
        threading.Thread(target=self._guard_loop, args=(stop,), name="tidal-guard", daemon=True).start()

    def _guard_loop(self, stop: threading.Event) -> None:
        """Every ``guard_interval``: online usage over the last interval from the
        online cgroups' cpu counters (two file reads; nanosecond counters, so one
        interval is enough). When online saturates its pool while cpus are lent,
        take them all back now instead of at the next period. A false alarm costs
        offline work a few periods of lending; a miss would cost online latency."""
        base = self.harvest.enforcement.base
        readers = [self.harvest.driver.usage_reader(p) for p in (f"{base}/shared", f"{base}/system")]
        files = PressureFiles(getattr(self.harvest.driver, "membership_dir", lambda path: None))
        # stalls on memory are rare: the node's one figure says when the online cgroups' need reading
        pressure = PressureMeter(files.read, self.harvest.usage.online_cgroups, "memory", files=files,
                                 gate=lambda: files.node_total("memory"))
        cpu_pressure = PressureMeter(files.read, self.harvest.usage.online_cgroups, "cpu", files=files)
        io_pressure = PressureMeter(files.read, self.harvest.usage.online_cgroups, "io", files=files)
        cpu_every = max(1, round(WINDOW_S / self.harvest.config.guard_interval))  # intervals per cpu pressure sample
        io_every = max(1, round(io_throttle.WINDOW_S / self.harvest.config.guard_interval))
        history: List[tuple] = []
        count = 0
        while not stop.is_set():
            time.sleep(self.harvest.config.guard_interval)  # Event.wait(timeout) costs ~10x the cpu of a sleep
            if stop.is_set():
                break
            now = time.monotonic()
            count += 1
            if self.harvest.throttle.threshold > 0:  # online stalls on memory: offline shrinks now, not next period
                stalled = pressure.sample(now)
                if stalled is not None and stalled >= self.harvest.throttle.threshold:
                    self.throttle_now(stalled)
            if self.harvest.cpu_loop.threshold > 0 and count % cpu_every == 0:
                cpu_pressure.sample(now)
                waiting = online_wait(cpu_pressure)
                if waiting is not None and waiting >= self.harvest.cpu_loop.threshold:
                    self.cpu_pressure_now(waiting)
            if self.harvest.io_guard.active and count % io_every == 0:
                io_pressure.sample(now)
                # online's own figure only: the node-wide one counts offline's waits on its own io
                if self.harvest.io_guard.on_window(online_wait(io_pressure), now):
                    counters = self.harvest.counters
                    with self.harvest.owner.lock:  # the limits reach the kernel now, through the Reconciler
                        if not self.stopping():
                            self.harvest.enforcement.reconcile()
                            # counted once written: whoever reads the count (status, metrics) finds the
                            # limit in the kernel (the VM tier once read io.max between the two)
                            counters["io_pressure_throttles"] = counters.get("io_pressure_throttles", 0) + 1
            with self.harvest.owner.lock:
                carved = self.carved()
            if not carved:  # nothing lent to take back: online's use is not read (two intervals after
                history.clear()  # lending starts, the rate is known again)
                continue
            total = sum(read() or 0 for read in readers)
            history.append((now, total))
            del history[:-2]
            if len(history) < 2:
                continue
            (t0, u0), (t1, u1) = history[0], history[-1]
            rate = (u1 - u0) / 1e6 / max(1e-6, t1 - t0)  # millicpu
            with self.harvest.owner.lock:
                pool = self.harvest.owner.pools()
                online_cpus = len(pool.shared) + len(pool.reserved)
                if self.carved() and rate >= self.harvest.sizer.saturation * online_cpus * 1000:
                    self.shrink_now(rate)
        files.close()

    def cpu_pressure_now(self, percent: float) -> bool:
        """Online waits for cpus while some are lent: take them all back now (and hold lending)."""
        with self.harvest.owner.lock:
            if self.stopping() or not self.harvest.cpu_loop.on_pressure(percent, self.carved()):
                return False
            log.info("online cpu pressure %.1f%% (threshold %g%%): every lent cpu taken back, lending held "
                     "%d periods", percent, self.harvest.cpu_loop.threshold, self.harvest.cpu_loop.holding)
            self.shrink_now(self.harvest.usage.online_millicpu)
            self.harvest.counters["cpu_pressure_shrinks"] = self.harvest.counters.get("cpu_pressure_shrinks", 0) + 1
            return True

    def carved(self) -> bool:
        """Whether offline holds cpus carved out of the shared pool (lent cpus the guard can take back)."""
        pool = self.harvest.owner.pools()
        return not set(pool.reclaimed) <= set(pool.lendable)

    def stopping(self) -> bool:
        """The agent is stopping: the guard writes nothing more (under the lock, checked after the
        agent's revert may have run, which would otherwise see its tree made again)."""
        return self._stop is not None and self._stop.is_set()

    def shrink_now(self, online_millicpu: float) -> None:
        """Give the shared pool every lent cpu and cut the capacity, in the kernel, now."""
        owner = self.harvest.owner
        with owner.lock:
            if self.stopping():
                return
            lay = _layout(owner.topology, owner.state)
            self.harvest.sizer.force(len(lay.free), int(online_millicpu))
            lendable = len(owner.pools().lendable)
            self.harvest.estimator.observe(time.monotonic(), time.time(), int(online_millicpu), self.harvest.usage.online_bytes)
            owner.commit(self.harvest.with_capacity(owner.state.with_reclaim_cpus(lendable)))
            self.harvest.enforcement.reconcile()
            self.harvest.counters["fast_shrinks"] = self.harvest.counters.get("fast_shrinks", 0) + 1

"""``tidal bench memory-isolation``: online latency and offline memory harvest, side by side.

The node is a box: a cgroup with a memory limit (``box_mib``) that holds the
whole run (this harness, the agent, the online service and the offline job),
so a run fills "the node" in seconds, on any host, without touching the rest of
the machine. Tidal reads that limit as the node's memory
(``KernelCgroups.memory_ceiling``: a parent with a limit bounds what it lends,
as under a slice with ``MemoryMax=``).

* The **online service** holds a working set of anonymous memory and page cache
  (a file it reads once) and answers a request every ``period_ms``: a few random
  pages of each, timed from the request's tick.
* The **offline job** grows anonymous memory to ``offline_share`` of what online
  leaves (a job sized to the node, then more page cache) and streams a file
  larger than the box (page cache) all along; killed, it starts again, as a
  batch framework retries a task.

Cpu: the plain treatments give the offline job the kubelet's BestEffort
weight on every cpu; Tidal its own treatment (``bench cpu-isolation`` compares
those). Treatments, taking turns (``repeats`` rounds):

* ``none``: both in the box, no memory settings (what a node without Tidal does);
* ``limit``: the offline job under a plain ``memory.max`` (v1: ``limit_in_bytes``)
  of what online leaves when it is warm (a static limit sized by hand);
* ``tidal``: Tidal's agent in-process on real cgroups, the service a
  ``shared_cores`` workload, the job ``reclaimed_cores``, Tidal's tree in the
  box as at a node's root, the agent's loop and fast guard running (capacity
  from online's measured use, ``memory.max``, ``memory.high`` and online's
  ``memory.low`` on v2, the soft limit on v1, the pressure throttle, eviction).

Reported: online p50/p99 and their ratio to online alone, online major faults,
OOM kills by side (a ``SIGKILL`` neither the harness nor Tidal sent), Tidal's
evictions, and the offline memory harvested as a share of what online leaves
(mean offline use / mean of the box less everything else; ``settled`` the same
over each round's second half, once the job has grown). Each treatment's p99 is
also given per round, with the median of those and its ratio to alone's (one
noisy round moves the pooled p99, not the median), and the spread of online
alone's rounds (largest p99 over smallest): the noise a ratio is read against.
The pooled ratio is the one held against the target. The files live in
``directory``, which must be disk-backed: page cache in ``tmpfs`` is never
reclaimed, and nothing of the page-cache half would be measured. Needs root.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from common.timing import median, percentile
from agent.errors import TidalError
from agent.isolation.cgroups.knobs import files_for

MIB = 1 << 20
PAGE = 4096
NOT_DISK = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")


# ---- the processes (run as `python -m agent.bench.memory_isolation online|offline ...`) ----

def _touch(area: mmap.mmap) -> None:
    for offset in range(0, len(area), PAGE):
        area[offset] = 1


def online_main(anon_mib: int, file_path: str, period_ms: float, duration: float, pages: int) -> None:
    sys.stdin.readline()  # placed in its cgroup: what it touches from here is charged there
    anon = mmap.mmap(-1, anon_mib * MIB)
    _touch(anon)
    fd = os.open(file_path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    # mapped, as a database or search index maps its files: a page the kernel took back is a major
    # fault when touched again (a read() that misses the cache is not counted as one)
    mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    checksum = 0
    for offset in range(0, size, PAGE):  # the file's pages into the page cache, charged to this cgroup
        checksum += mapped[offset]
    rng = random.Random(1)
    anon_pages, file_pages = anon_mib * MIB // PAGE, size // PAGE
    print("ready", flush=True)
    sys.stdin.readline()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    period = period_ms / 1000.0
    latencies: List[float] = []
    next_tick = time.perf_counter() + period
    end = next_tick + duration
    while next_tick < end:
        delay = next_tick - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        for _ in range(pages):
            anon[rng.randrange(anon_pages) * PAGE] = 2
            checksum += mapped[rng.randrange(file_pages) * PAGE]
        latencies.append((time.perf_counter() - next_tick) * 1e6)
        next_tick += period
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0
    print(json.dumps({"latencies_us": latencies, "major_faults": faults}), flush=True)


def offline_main(anon_mib: int, rate_mib_s: float, stream_path: str) -> None:
    sys.stdin.readline()
    held, chunks = 0, []
    fd = os.open(stream_path, os.O_RDONLY)
    position, tick = 0, 0.02
    chunk = max(1, int(rate_mib_s * tick * MIB)) // PAGE * PAGE or PAGE
    while True:
        start = time.monotonic()
        if held < anon_mib * MIB:
            area = mmap.mmap(-1, min(chunk, anon_mib * MIB - held))
            _touch(area)
            chunks.append(area)
            held += len(area)
        data = os.pread(fd, 2 * MIB, position)  # streaming reads: page cache, charged here
        position = position + len(data) if data else 0
        time.sleep(max(0.0, tick - (time.monotonic() - start)))


# ---- the harness ----------------------------------------------------------------

def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One treatment's rounds, pooled: latency percentiles over every request, each round's p99 (how much
    they differ is the noise a ratio must be read against) and their median, faults, kills, and the offline harvest over
    the whole rounds and over their second halves (``settled``: after the job's growth, which under
    emulation takes most of a short round)."""
    pooled = [x for r in rows for x in r["latencies_us"]]
    out: Dict[str, Any] = {"p50_us": round(percentile(pooled, 50), 1) if pooled else None,
                           "p99_us": round(percentile(pooled, 99), 1) if pooled else None,
                           "p99_us_by_round": [round(percentile(r["latencies_us"], 99), 1) if r["latencies_us"] else None
                                               for r in rows],
                           "samples": len(pooled),
                           "major_faults": sum(r["major_faults"] or 0 for r in rows),
                           "oom_kills": {side: sum(r["oom_kills"][side] for r in rows) for side in ("online", "offline")},
                           "offline_refused": sum(r.get("refused", 0) for r in rows)}
    by_round = [p for p in out["p99_us_by_round"] if p is not None]
    out["p99_us_round_median"] = round(median(by_round), 1) if by_round else None
    for suffix in ("", "_settled"):
        with_use = [r for r in rows if f"offline_bytes{suffix}" in r]
        if with_use:
            used = sum(r[f"offline_bytes{suffix}"] for r in with_use) / len(with_use)
            left = sum(r[f"left_bytes{suffix}"] for r in with_use) / len(with_use)
            out[f"offline_mib{suffix}"] = round(used / MIB, 1)
            out[f"left_by_online_mib{suffix}"] = round(left / MIB, 1)
            out[f"offline_harvest{suffix}"] = round(used / left, 3) if left else None
    for key in ("quiet_wait_s", "evictions", "throttles", "kernel_confinements", "limits", "protection",
                "online_memory_low", "seen"):
        if rows and key in rows[-1]:
            out[key] = [r[key] for r in rows] if key != "evictions" else [e for r in rows for e in r[key]]
    return out


def round_spread(summary: Dict[str, Any]) -> Optional[float]:
    """The largest round's p99 over the smallest's: 1.0 for identical rounds, ``None`` under two rounds."""
    p99s = [p for p in summary["p99_us_by_round"] if p]
    return round(max(p99s) / min(p99s), 3) if len(p99s) >= 2 else None


def wait_for_quiet_host(busy_share: float = 0.25, calm_samples: int = 2, interval: float = 0.5,
                        limit: float = 30.0) -> Optional[float]:
    """Wait until the host's cpus are busy under ``busy_share`` for ``calm_samples`` intervals in a row;
    the seconds waited, or ``None`` when it stayed busy for ``limit`` seconds (the round then runs anyway,
    and its report says so)."""
    import psutil

    start, calm = time.monotonic(), 0
    psutil.cpu_percent(interval=None)
    while calm < calm_samples:
        if time.monotonic() - start > limit:
            return None
        calm = calm + 1 if psutil.cpu_percent(interval=interval) < busy_share * 100 else 0
    return round(time.monotonic() - start, 2)


def check_disk_backed(directory: str) -> str:
    """The filesystem type under ``directory``; a ``TidalError`` where page cache would not be reclaimable."""
    import psutil

    # the longest mount point holding it; of several at one point, the last mounted (it hides the others)
    listed = list(enumerate(psutil.disk_partitions(all=True)))
    parts = [p for _, p in sorted(listed, key=lambda ip: (len(ip[1].mountpoint), ip[0]), reverse=True)]
    real = os.path.realpath(directory)
    for part in parts:
        if real == part.mountpoint or real.startswith(part.mountpoint.rstrip("/") + "/"):
            fstype = part.fstype
            if fstype == "overlay":
                upper = [o.split("=", 1)[1] for o in part.opts.split(",") if o.startswith("upperdir=")]
                if upper and upper[0] != directory:
                    fstype = f"overlay on {check_disk_backed(upper[0])}"
            if fstype.split()[-1] in NOT_DISK:
                raise TidalError(f"{directory}: on {fstype}, whose page cache is never reclaimed; give a "
                                 f"directory on a disk-backed filesystem (--dir)")
            return fstype
    return "unknown"


def _write_file(path: str, size_mib: int) -> None:
    block = os.urandom(MIB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(size_mib):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    _drop_cache(path)


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Sampler(threading.Thread):
    """Offline's memory use and what the rest of the box leaves it, every 100 ms."""

    def __init__(self, box_bytes: int, read_box: Callable[[], Optional[int]], read_offline: Callable[[], Optional[int]]):
        super().__init__(daemon=True)
        self.box_bytes, self.read_box, self.read_offline = box_bytes, read_box, read_offline
        self.stop = threading.Event()
        self.offline: List[int] = []
        self.left: List[int] = []

    def run(self) -> None:
        while not self.stop.wait(0.1):
            box, offline = self.read_box(), self.read_offline() or 0
            if box is not None:
                self.offline.append(offline)
                self.left.append(max(0, self.box_bytes - (box - offline)))


class _Scenario:
    """One run: the online service, and unless alone the offline job (restarted when killed)."""

    def __init__(self, args: Dict[str, Any], offline_anon_mib: int) -> None:
        self.args = args
        self.offline_anon_mib = offline_anon_mib
        self.cmd = [sys.executable, "-m", "agent.bench.memory_isolation"]
        self.online: Optional[subprocess.Popen] = None
        self.offline: Optional[subprocess.Popen] = None
        self.offline_oom = 0
        self.refused = 0
        self.retry_at = 0.0

    def start_online(self, place: Callable[[int], None]) -> None:
        a = self.args
        self.online = subprocess.Popen(self.cmd + ["online", str(a["online_anon_mib"]), a["online_file"], str(a["period_ms"]),
                                                   str(a["duration"]), str(a["pages"])],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        place(self.online.pid)
        self._say(self.online, "setup")
        if self.online.stdout.readline().strip() != "ready":
            raise TidalError("the online service failed to build its working set")

    def start_offline(self, place: Callable[[int], None]) -> None:
        """Start the job (again); a placement the agent refuses (no room in its capacity) is counted, and
        the job waits for the next try, as a task waits for a scheduler's offer."""
        from agent.errors import Unfit

        a = self.args
        # placed before it runs, as a runtime or a node manager puts a container's first process in its cgroup
        # before exec: a shell waits for "placed", then execs the job (same pid), which waits for "go". Started
        # and then placed, the interpreter's start (tens of ms, much of it in the kernel) ran outside any
        # treatment, on whatever cpu, at every restart of a job that outgrows its limit
        self.offline = subprocess.Popen(["/bin/sh", "-c", 'read placed && exec "$@"', "sh"] + self.cmd + [
            "offline", str(self.offline_anon_mib), str(a["offline_rate_mib_s"]), a["stream_file"]],
            stdin=subprocess.PIPE, text=True)
        try:
            place(self.offline.pid)
        except Unfit:
            self.refused += 1
            self.offline.kill()
            self.offline.wait()
            self.retry_at = time.monotonic() + 0.5
            return
        self._say(self.offline, "placed")
        self._say(self.offline, "go")

    @staticmethod
    def _say(proc: subprocess.Popen, line: str) -> None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    def run(self, place_offline: Optional[Callable[[int], None]], evicted: Callable[[], set]) -> Dict[str, Any]:
        self._say(self.online, "go")
        # its report (a latency per request) is read as it is written: past a pipe's 64 KiB (a run of
        # about 18 s) the service would block writing it while this waited for it to exit
        report: List[str] = []
        reader = threading.Thread(target=lambda: report.append(self.online.stdout.read()), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.args["duration"] * 6 + 60
        while self.online.poll() is None and time.monotonic() < deadline:
            if place_offline is not None and self.offline is not None and self.offline.poll() is not None \
                    and time.monotonic() >= self.retry_at:
                if self.offline.returncode == -signal.SIGKILL and self.offline.pid not in evicted() and not self.retry_at:
                    self.offline_oom += 1
                self.retry_at = 0.0
                self.start_offline(place_offline)  # the framework retries the task
            time.sleep(0.05)
        if self.online.poll() is None:
            raise TidalError("the online service did not finish")
        reader.join()
        out = report[0] if report else ""
        online_oom = int(self.online.returncode == -signal.SIGKILL and self.online.pid not in evicted())
        result = json.loads(out) if self.online.returncode == 0 else {"latencies_us": [], "major_faults": None}
        result["oom_kills"] = {"online": online_oom, "offline": self.offline_oom}
        result["refused"] = self.refused
        return result

    def kill(self) -> None:
        for proc in (self.online, self.offline):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def run(box_mib: int = 512, online_anon_mib: int = 64, online_file_mib: int = 64, offline_share: float = 0.8,
        offline_rate_mib_s: float = 128.0, duration: float = 10.0, repeats: int = 2, period_ms: float = 5.0,
        pages: int = 8, directory: str = "/var/tmp", progress: Callable[[str], None] = lambda line: None) -> Dict[str, Any]:
    if os.geteuid() != 0:
        raise TidalError("bench memory-isolation needs root: it creates cgroups")
    from agent.daemon import Agent, AgentConfig
    from agent.isolation.cgroups.desired import CgroupSpec
    from agent.isolation.cgroups.detect import detect
    from agent.isolation.cgroups.driver import KernelCgroups
    from agent.isolation.cgroups.reconcile import Reconciler
    from agent.topology import HostFS, discover
    from agent.topology.parse import format_cpulist

    if box_mib < 256:
        raise TidalError(f"--box {box_mib} MiB: at least 256 MiB (the interpreters alone take ~100)")
    fstype = check_disk_backed(directory)
    topo = discover(HostFS("/"), use_cpuinfo_lib=False)
    mounts = detect(HostFS("/"))
    if not mounts.features.get("memory"):
        raise TidalError("bench memory-isolation needs the memory controller")
    driver = KernelCgroups(mounts, parent="self")
    box = f"tidal-bench-mem-{uuid.uuid4().hex[:8]}"
    every = format_cpulist(topo.online_cpus())
    mems = format_cpulist(n.id for n in topo.numa_nodes if n.cpus) or "0"
    box_bytes = box_mib * MIB
    work = tempfile.mkdtemp(prefix="tidal-bench-mem-", dir=directory)
    args = {"online_anon_mib": online_anon_mib, "online_file": os.path.join(work, "online.bin"),
            "stream_file": os.path.join(work, "stream.bin"), "period_ms": period_ms, "duration": duration,
            "pages": pages, "offline_rate_mib_s": offline_rate_mib_s}

    def apply(specs: List[CgroupSpec]) -> None:
        report = Reconciler(driver, box).apply(specs)
        if report.failed:
            raise TidalError(f"bench cgroups: {report.failed[0][2]}")

    def cg(extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        return {"cpus": every, "mems": mems, **(extra or {})}

    # cpu: in the plain treatments the kubelet's BestEffort treatment of the offline job (the lowest
    # weight, every cpu), as a node without Tidal runs it; Tidal's treatment is its own (bench
    # cpu-isolation compares those): what differs between the rows is memory, and Tidal's cpu policy
    if len(topo.online_cpus()) < 2:
        raise TidalError("bench memory-isolation needs at least 2 online cpus")
    lowest = {"cpu_shares": 2}
    groups = {"harness": cg(), "online": cg({"cpu_shares": 1024}), "offline": cg(lowest)}
    own_pid = os.getpid()

    def enter_box() -> None:
        apply([CgroupSpec(box, cg({"memory_max": box_bytes}))] +
              [CgroupSpec(f"{box}/{name}", knobs) for name, knobs in groups.items()])
        driver.move(f"{box}/harness", own_pid)

    def leave_box() -> None:
        Reconciler(driver, box).revert()  # this process goes back to the cgroup it came from

    def box_usage() -> Optional[int]:
        return driver.memory_usage_bytes(box)

    progress(f"writing {online_file_mib} + {2 * box_mib} MiB of files in {work} ({fstype})")
    _write_file(args["online_file"], online_file_mib)
    _write_file(args["stream_file"], 2 * box_mib)

    def plain(offline_limit: Optional[int]):
        def setup(scenario: _Scenario):
            groups["offline"] = cg({**lowest, **({"memory_max": offline_limit} if offline_limit else {})})
            enter_box()
            scenario.start_online(lambda pid: driver.move(f"{box}/online", pid))
            return (lambda pid: driver.move(f"{box}/offline", pid)), (lambda: driver.memory_usage_bytes(f"{box}/offline")), \
                (lambda: set()), (lambda: None), {}
        return setup

    def tidal(scenario: _Scenario):
        groups["offline"] = cg(lowest)
        enter_box()
        state_dir = tempfile.mkdtemp(prefix="tidal-bench-state-")
        # the node is the box: the node-scale memory settings follow its size (a real node's defaults, 1 GiB
        # reserved and a 256 MiB watermark, would leave nothing of a 512 MiB node); the rest shipped
        config = AgentConfig(socket_path=os.path.join(state_dir, "a.sock"), state_dir=state_dir,
                             cgroup_base=f"tidal-{box}", cgroup_parent="self", period=0.5, empty_grace=3600,
                             confine_self=True, memory_reserved_bytes=box_bytes // 16,
                             memory_evict_below=box_bytes // 32)
        # Tidal's tree in the box, beside the harness (as at a node's root: its memory.low counts against the
        # box's limit; under the harness's cgroup, which has none, it would protect nothing)
        tree = driver.below(box)
        tree.prepare(config.cgroup_base)  # as the agent does with its own driver: checks, and what the kernel offers
        agent = Agent(config, echo=lambda line: None, topology=topo, driver=tree)
        agent.start()
        agent.harvest.estimator.deadband_bytes = box_bytes // 16  # 256 MiB on a real node: half this one
        agent.admit({"name": "online", "qos": "shared_cores", "millicpu": 200})
        scenario.start_online(lambda pid: agent.attach("online", pid))
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(config.period):
                agent.tick()

        thread = threading.Thread(target=loop, daemon=True)
        for _ in range(3):  # a few periods of sampling: the capacity from online's measured use
            agent.tick()
            time.sleep(config.period)
        thread.start()
        agent.start_guard()
        tasks = iter(range(1, 1 << 30))

        def place(pid: int) -> None:
            # each attempt a workload of its own, as a framework names each task attempt (an evicted one's
            # cgroup goes once its process has exited); refused while the capacity has no room (Unfit)
            name = f"batch-{next(tasks)}"
            agent.admit({"name": name, "qos": "reclaimed_cores", "millicpu": 100, "tier": "low"})
            agent.attach(name, pid)

        def evicted() -> set:
            return {pid for e in agent.eviction.evictions for pid in e["pids"]}

        def cleanup() -> None:
            stop.set()
            thread.join()
            agent.shutdown()
            agent.enforcement.reconciler.revert()
            shutil.rmtree(state_dir, ignore_errors=True)  # the agent's state and socket: nothing left behind

        # the offline job asks for 100 millicpu: on a host whose cpus are busy (the run before this one
        # still winding down) the capacity may have no room for seconds, and a short round would measure
        # an offline side that never ran; wait for room (the periods go on), and say so if it never comes
        deadline = time.monotonic() + 30
        while (agent.state.reclaim_millicpu or 0) < 100 and agent.state.reclaim_millicpu is not None:
            if time.monotonic() > deadline:
                cleanup()
                raise TidalError(f"no reclaimed cpu capacity for the offline job after 30 s "
                                 f"({agent.state.reclaim_millicpu} millicpu; online uses {agent.usage.online_millicpu} "
                                 "millicpu): this host's cpus are busy")
            time.sleep(config.period)
        base = config.cgroup_base
        info = {"agent": agent}
        return place, (lambda: agent.driver.memory_usage_bytes(f"{base}/reclaimed")), evicted, cleanup, info

    def one(name: str, setup, offline_anon: int) -> Dict[str, Any]:
        for path in (args["online_file"], args["stream_file"]):
            _drop_cache(path)
        # the treatment before (its job killed, its memory freed) must not be measured as this one's online
        # use: Tidal's capacity keeps online's peak for minutes, so a start on a busy host would leave the job
        # no room for the whole round
        waited = wait_for_quiet_host()
        if waited is None:
            progress(f"{name}: the host's cpus stayed over 25% busy for 30 s; this round runs anyway")
        scenario = _Scenario(args, offline_anon)
        cleanup: Callable[[], None] = lambda: None  # noqa: E731
        try:
            place, read_offline, evicted, cleanup, info = setup(scenario)
            warm = box_usage() or 0
            sampler = _Sampler(box_bytes, box_usage, read_offline)
            if name != "alone":
                scenario.start_offline(place)
            sampler.start()
            result = scenario.run(place if name != "alone" else None, evicted)
            sampler.stop.set()
            sampler.join()
            result["warm_box_bytes"] = warm
            result["quiet_wait_s"] = waited
            if name != "alone" and sampler.left:
                half = len(sampler.left) // 2
                for suffix, start in (("", 0), ("_settled", half)):
                    result[f"offline_bytes{suffix}"] = sum(sampler.offline[start:]) / len(sampler.offline[start:])
                    result[f"left_bytes{suffix}"] = sum(sampler.left[start:]) / len(sampler.left[start:])
            if "agent" in info:
                agent = info["agent"]
                result["evictions"] = [{"cause": e["cause"], "reason": e["reason"]} for e in agent.eviction.evictions]
                result["throttles"] = agent.harvest.counters.get("pressure_throttles", 0)
                result["kernel_confinements"] = agent.harvest.kernel_work.confinements
                result["limits"] = list(agent.harvest.limits()[1:])
                result["protection"] = dict(agent.harvest.protection.current())
                # the service's own cgroup, where its pages are charged: its share of the tree's (v2)
                # (the file by the knob table's name for it: only isolation names the kernel's files)
                low = next((agent.driver.read(controller, f"{agent.enforcement.base}/shared/online", file)
                            for controller, file, _ in files_for(agent.driver.version, "memory_low", 0)), None)
                result["online_memory_low"] = None if low is None else low.strip()
                result["seen"] = {"node_bytes": agent.harvest.memory_total(), "online_bytes": agent.usage.online_bytes,
                                  "available_bytes": agent.usage.available_bytes}
            return result
        finally:
            scenario.kill()
            cleanup()
            leave_box()

    try:
        progress("online alone")
        alone = [one("alone", plain(None), 0)]
        left = box_bytes - max(r["warm_box_bytes"] for r in alone)
        offline_anon = max(1, int(left * offline_share) // MIB)
        treatments = {"none": plain(None), "limit": plain(left), "tidal": tidal}
        results: Dict[str, List[Dict[str, Any]]] = {name: [] for name in treatments}
        for round_ in range(repeats):
            if round_:
                alone.append(one("alone", plain(None), 0))
            for name, setup in treatments.items():
                progress(f"round {round_ + 1}/{repeats}: {name}")
                results[name].append(one(name, setup, offline_anon))
    finally:
        leave_box()
        for path in (args["online_file"], args["stream_file"]):
            try:
                os.unlink(path)
            except OSError:
                pass
        os.rmdir(work)

    alone_summary = summarize(alone)
    alone_summary["p99_spread"] = round_spread(alone_summary)
    scenarios = {}
    for name, rows in results.items():
        s = summarize(rows)
        for pct in ("p50", "p99", "p99_round_median"):
            key = "p99_us_round_median" if pct == "p99_round_median" else f"{pct}_us"
            s[f"{pct}_ratio"] = round(s[key] / alone_summary[key], 3) if s[key] and alone_summary[key] else None
        scenarios[name] = s
    t = scenarios["tidal"]
    targets = {"online_p99_ratio_max": 1.2, "online_oom_kills": 0, "offline_harvest_min": 0.8}
    met = {"online_p99_ratio": t["p99_ratio"] is not None and t["p99_ratio"] <= 1.2,
           "online_oom_kills": t["oom_kills"]["online"] == 0,
           "offline_harvest": (t.get("offline_harvest") or 0) >= 0.8}
    return {"alone": alone_summary, "scenarios": scenarios, "targets": targets, "tidal_met": met,
            "repeats": repeats, "cgroup_version": driver.version, "kernel": os.uname().release,
            "box_mib": box_mib, "online_anon_mib": online_anon_mib, "online_file_mib": online_file_mib,
            "offline_anon_mib": offline_anon, "offline_rate_mib_s": offline_rate_mib_s,
            "stream_file_mib": 2 * box_mib, "duration_s": duration, "period_ms": period_ms,
            "pages_per_request": pages, "filesystem": fstype}


if __name__ == "__main__":
    if sys.argv[1] == "online":
        online_main(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
    elif sys.argv[1] == "offline":
        offline_main(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])

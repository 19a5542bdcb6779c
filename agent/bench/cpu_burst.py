"""``tidal bench cpu-burst``: a bursty online service under a cpu limit, with and without burst.

An online service whose requests come one at a time at random (exponential gaps, ``gap_ms`` on
average) and each cost ``cost_ms`` of its own cpu, in a ``shared_cores`` workload limited to
``limit_millicpu`` (its quota): on average it uses far less than the quota, but one request costs more
than a period's quota, so without burst the kernel throttles it in the middle of a request and the
request waits for the next period. With burst (``--online-cpu-burst``, shipped 100: the quota it left
unused in earlier periods, up to one quota more) the request runs through.

Each treatment runs a real agent as shipped (the CLI, its default period and options; a unique cgroup
tree and state directory, removed afterwards) and the service with ``tidal run --limit-millicpu``:

* ``burst``: the agent's default burst (100% of the quota);
* ``no_burst``: ``--online-cpu-burst 0``.

Treatments take turns, ``repeats`` rounds each. Reported per treatment: request latency p50/p99 (arrival
to done; an arrival while a request runs waits for it, as a one-thread server's queue), throttled
periods and throttled time from the workload's own cpu.stat, and the ratios of no_burst to burst.
Needs root (real cgroups).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List

from agent.errors import TidalError
from common.process import terminate
from common.timing import median, percentile

# the service, run inside the workload: its own cgroup's cpu.stat (v1 or v2), then requests for SECONDS
SERVICE = r"""
import json, random, sys, time
seconds, gap, cost = float(sys.argv[1]), float(sys.argv[2]) / 1000, float(sys.argv[3]) / 1000
fixed = sys.argv[5] == "fixed"  # a request every gap, else exponential gaps of that mean
mounts = {}
for line in open("/proc/self/mounts"):
    f = line.split()
    if f[2] == "cgroup2": mounts.setdefault("", f[1])
    elif f[2] == "cgroup" and "cpu" in f[3].split(","): mounts["cpu"] = f[1]
for line in open("/proc/self/cgroup"):
    hid, ctl, path = line.rstrip("\n").split(":", 2)
    if ("cpu" in ctl.split(",") and "cpu" in mounts) or (hid == "0" and "cpu" not in mounts):
        stat = (mounts["cpu"] if "cpu" in mounts else mounts[""]) + path + "/cpu.stat"
def read():
    values = dict(l.split() for l in open(stat))
    us = int(values["throttled_usec"]) if "throttled_usec" in values else int(values["throttled_time"]) // 1000
    return int(values["nr_throttled"]), int(values["nr_periods"]), us
time.sleep(1.0)  # the interpreter's start is not a request
before = read()
rng = random.Random(int(sys.argv[4]))
latencies, arrival, end = [], time.monotonic(), time.monotonic() + seconds
while True:
    arrival += gap if fixed else rng.expovariate(1.0 / gap)
    if arrival > end:
        break
    now = time.monotonic()
    if arrival > now:
        time.sleep(arrival - now)
    start = time.thread_time()
    while time.thread_time() - start < cost:
        pass
    latencies.append((time.monotonic() - arrival) * 1000)
after = read()
files = {}
for name in ("cpu.max", "cpu.max.burst", "cpu.cfs_quota_us", "cpu.cfs_burst_us"):  # the quota and burst in force
    try:
        files[name] = open(stat.rsplit("/", 1)[0] + "/" + name).read().strip()
    except OSError:
        pass
print(json.dumps({"latencies_ms": latencies, "throttled": after[0] - before[0], "periods": after[1] - before[1],
                  "throttled_ms": (after[2] - before[2]) / 1000, "files": files}))
"""

TREATMENTS = {"burst": (), "no_burst": ("--online-cpu-burst", "0")}


def _agent(work: str, base: str, extra) -> subprocess.Popen:
    from agent.client import AgentClient

    sock = os.path.join(work, "a.sock")
    with tempfile.TemporaryFile() as log:  # the agent's output, shown if it does not start
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--socket", sock, "--state-dir",
                                 os.path.join(work, "state"), "--cgroup-base", base, "--revert", *extra],
                                stdout=log, stderr=subprocess.STDOUT)
        client = AgentClient(sock, timeout=15)
        deadline = time.monotonic() + 60
        while not (os.path.exists(sock) and client.call("GET", "/v1/health")[0] == 200):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log.seek(0)
                raise TidalError(f"bench cpu-burst: the agent did not start: {log.read()[-500:].decode(errors='replace')}")
            time.sleep(0.1)
    return proc


def one_round(treatment: str, seconds: float, limit_millicpu: int, gap_ms: float, cost_ms: float,
              seed: int, fixed: bool = False) -> Dict[str, Any]:
    """One run of the service under a fresh agent: its latencies, throttling and the cgroup's quota and
    burst files as it saw them (``fixed``: a request every ``gap_ms``, else exponential gaps)."""
    with tempfile.TemporaryDirectory(prefix="tidal-bench-burst-") as work:
        agent = _agent(work, f"tidal-bench-burst-{uuid.uuid4().hex[:8]}", TREATMENTS[treatment])
        try:
            done = subprocess.run([sys.executable, "-m", "agent.cli", "run", "--socket", os.path.join(work, "a.sock"),
                                   "--qos", "shared_cores", "--millicpu", str(max(10, limit_millicpu // 2)),
                                   "--limit-millicpu", str(limit_millicpu), "--name", "service", "--",
                                   sys.executable, "-c", SERVICE, str(seconds), str(gap_ms), str(cost_ms), str(seed),
                                   "fixed" if fixed else "exp"],
                                  capture_output=True, text=True, timeout=seconds + 120)
            if done.returncode != 0:
                raise TidalError(f"bench cpu-burst: the service failed: {done.stderr.strip()[-300:]}")
            return json.loads(done.stdout)
        finally:
            terminate(agent)


def run(seconds: float = 20.0, repeats: int = 2, limit_millicpu: int = 200, gap_ms: float = 500.0,
        cost_ms: float = 30.0) -> Dict[str, Any]:
    if os.geteuid() != 0:
        raise TidalError("bench cpu-burst needs root: the agent creates cgroups")
    rounds: Dict[str, List[Dict[str, Any]]] = {name: [] for name in TREATMENTS}
    for index in range(repeats):
        for name in TREATMENTS:  # the same arrivals (seed) for both in a round
            rounds[name].append(one_round(name, seconds, limit_millicpu, gap_ms, cost_ms, seed=index))
    out: Dict[str, Any] = {"bench": "cpu-burst", "seconds": seconds, "repeats": repeats,
                           "limit_millicpu": limit_millicpu, "request_gap_ms": gap_ms, "request_cost_ms": cost_ms,
                           "quota_ms_per_period": limit_millicpu / 10, "treatments": {}}
    for name, results in rounds.items():
        latencies = sorted(x for r in results for x in r["latencies_ms"])
        out["treatments"][name] = {
            "agent_flags": list(TREATMENTS[name]) or ["(shipped: --online-cpu-burst 100)"],
            "requests": len(latencies),
            "p50_ms": round(percentile(latencies, 50), 2) if latencies else None,
            "p99_ms": round(percentile(latencies, 99), 2) if latencies else None,
            "p99_ms_round_median": round(median([percentile(sorted(r["latencies_ms"]), 99) for r in results
                                                 if r["latencies_ms"]]), 2),
            "throttled_periods": sum(r["throttled"] for r in results),
            "periods": sum(r["periods"] for r in results),
            "throttled_ms": round(sum(r["throttled_ms"] for r in results), 1),
        }
    burst, none = out["treatments"]["burst"], out["treatments"]["no_burst"]
    out["no_burst_over_burst"] = {
        "p99": round(none["p99_ms"] / burst["p99_ms"], 2) if burst["p99_ms"] else None,
        "p50": round(none["p50_ms"] / burst["p50_ms"], 2) if burst["p50_ms"] else None,
        "throttled_periods": f"{none['throttled_periods']} vs {burst['throttled_periods']}"}
    return out

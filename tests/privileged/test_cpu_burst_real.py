"""CPU burst on real cgroups (v1 on the host, v2 in make test-cgroup2's VM), the agent as shipped.

A shared_cores workload limited to 200 millicpu (20 ms a 100 ms period) rests a second, then spends
30 ms of its own cpu at once, five times (``tidal bench cpu-burst``'s service, requests a second apart).
With the shipped burst (100% of the quota: the 20 ms it left unused may be borrowed) the kernel never
throttles it; with ``--online-cpu-burst 0`` it does, as 30 ms cannot fit a 20 ms quota unless a spike
straddles a period's end (under 1 in 5 a spike: five spikes all straddling is about 1 in 3,000). The
service counts its own cgroup's throttled periods (cpu.stat, from after its interpreter's start)."""

from __future__ import annotations

import json

import pytest

from agent.bench.cpu_burst import one_round
from tests.conftest import privileged

pytestmark = [pytest.mark.privileged, privileged]


def quota_and_burst(files):
    if "cpu.max" in files:
        return files["cpu.max"].split()[0], files["cpu.max.burst"]
    return files["cpu.cfs_quota_us"], files["cpu.cfs_burst_us"]


def test_a_limited_workloads_spikes_borrow_the_quota_it_left_unused():
    # A spike is throttled without the burst only if the service gets over 20 ms of cpu within one
    # period; on a host busy with other work (CI once: 15 active periods for the five spikes, none
    # throttled) it gets less, and that trial shows nothing about the burst. Such a trial is printed and
    # the pair run again, three trials at most; the burst must never be throttled in any of them.
    for trial in range(1, 4):
        on = one_round("burst", 5.5, 200, 1000, 30, seed=0, fixed=True)
        off = one_round("no_burst", 5.5, 200, 1000, 30, seed=0, fixed=True)
        print(json.dumps({"trial": trial,
                          "burst": {k: v for k, v in on.items() if k != "latencies_ms"},
                          "no_burst": {k: v for k, v in off.items() if k != "latencies_ms"},
                          "no_burst_latencies_ms": [round(x, 1) for x in off["latencies_ms"]]}))
        assert len(on["latencies_ms"]) == len(off["latencies_ms"]) == 5
        assert quota_and_burst(on["files"]) == ("20000", "20000"), on["files"]
        assert on["throttled"] == 0, f"throttled {on['throttled']} periods with a burst of the whole quota"
        assert quota_and_burst(off["files"]) == ("20000", "0"), off["files"]
        if off["throttled"] >= 1:
            return
    pytest.fail("five 30 ms spikes under a 20 ms quota and no burst were never throttled in three trials")

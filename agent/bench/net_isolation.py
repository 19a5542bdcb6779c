"""``tidal bench net-isolation``: online latency under an offline flood, side by side.

Three network namespaces the benchmark makes (``netlab``): host -> wire ->
peer, where the wire forwards through a TBF at ``link_mbps`` with a switch-like
buffer (256 KiB): a link of known rate. The peer runs a UDP echo server (the
online service) and a TCP sink. From the host:

* ``unloaded``: online request/response alone (64-byte UDP, ``rr_rate``/s);
* ``none``: the same beside an offline bulk TCP flood, no shaping;
* ``tidal``: the node as Tidal runs it: Tidal's shaper on the host NIC
  (``NetShaper``, the agent's component, re-rated every 0.5 s as the agent's
  loop does), and the flood started where Tidal runs reclaimed work: in a
  cgroup2 cgroup that the classifier counts as offline, under ``SCHED_IDLE``
  (what ``cpu.idle=1`` on the agent's reclaimed pool gives its tasks);
* ``tidal_shaper_only``: the shaper alone, the flood at normal cpu priority
  (what the network part contributes on its own).

Scenarios take turns, ``repeats`` rounds; latency percentiles are over all
rounds' samples pooled, throughput is the median round's. Each round's own
p99 is listed too (``p99_us_by_round``), and the unloaded scenario's share of
round trips over 1 ms: on a virtual machine the hypervisor alone stalls a few
round trips in a thousand by milliseconds, unloaded too, and when those come
near 1% the p99s measure the machine more than the shaper. ``offline_share``
is what the flood had of the link over what online left of it (link -
online's own traffic), both counted as the link counts its rate: frames with
their headers, read off the link's own queue (``offline_wire_mbps``).
``offline_mbps`` is the flood's goodput (TCP payload, what iperf3 prints);
``offline_goodput_share`` sets that against the same remainder, and cannot
pass MSS / frame (1448 / 1514 = 0.956 here) even for a flow that fills the
link. Also per scenario: the p99 of the shaped direction alone
(``forward_p99_us``, client send to the server's arrival stamp, one clock),
the share of round trips over 1 ms, the packets the link's queue dropped, and
the share of the online cpu spent in softirq (``online_cpu_softirq``: a shared
qdisc is run, and its timer fires, on whichever cpu touched it last, so the
online cpu carries some of offline's packets; here each of those also crosses
the emulated wire and the peer's TCP stack, which a NIC does not cost), and
how busy the other cpus were (``offline_cpus_busy``: near 1, the flood is
limited by the cpu that also plays the wire and the peer, not by the shaper).

Every scenario gets the same cpu placement (online client and server on the
first cpu, everything else on the others, including the wire's and the peer's
packet processing: ``NetLab(far_cpus=...)``) and, unless ``pm_qos`` is off, the
same PM QoS request that keeps idle cpus from halting (``wakeup.py`` says why
a virtual machine needs it). Needs root, nft and nsenter; everything made is
removed after.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from agent.bench.netlab import SERVICE, NetLab
from common.timing import median, percentile
from agent.bench.wakeup import WakeupLatencyHold
from agent.errors import TidalError

MBIT = 1_000_000
RR_BYTES = 64 + 28 + 14  # payload + IP/UDP + Ethernet, each way
SCENARIOS = ("unloaded", "none", "tidal", "tidal_shaper_only")


def _rr(lab: NetLab, seconds: float, rate: float, cpus) -> Dict[str, Any]:
    proc = lab.spawn(lab.host, ["rr", SERVICE, "5002", str(seconds), str(rate)], cpus=cpus)
    out, err = proc.communicate(timeout=seconds + 30)
    if proc.returncode != 0:
        raise TidalError(f"bench net-isolation: request/response client failed: {err.strip()[:200]}")
    return json.loads(out)


def _wire_counters(lab: NetLab) -> Dict[str, int]:
    """What the emulated link has carried towards the peer so far (frames as sent: Ethernet
    header on, as the link's rate counts them) and what its queue dropped (a full switch buffer)."""
    from pyroute2 import IPRoute

    with IPRoute(netns=lab.wire) as ipr:
        index = ipr.link_lookup(ifname="w1")[0]
        for msg in ipr.get_qdiscs(index):
            if msg.get_attr("TCA_KIND") == "tbf":
                stats = msg.get_attr("TCA_STATS2")
                return {"bytes": stats.get_attr("TCA_STATS_BASIC")["bytes"],
                        "drops": stats.get_attr("TCA_STATS_QUEUE")["drops"]}
    raise TidalError("bench net-isolation: the emulated link lost its TBF")


def _round(lab: NetLab, seconds: float, rate: float, flood_cgroup: Optional[str], plan: Dict[str, Any],
           shaper=None, flood_idle: bool = False) -> Dict[str, Any]:
    wire = _wire_counters(lab)
    flood = None
    if flood_cgroup is not False:
        flood = lab.spawn(lab.host, ["send", SERVICE, "5001", str(seconds + 1.0)],
                          cgroup_procs=os.path.join(flood_cgroup, "cgroup.procs") if flood_cgroup else None,
                          cpus=plan["offline"], sched_idle=flood_idle)
        time.sleep(0.5)  # let TCP fill the link before measuring
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            shaper.adjust()

    ticker = threading.Thread(target=loop, daemon=True) if shaper else None
    if ticker:
        ticker.start()
    before = _cpu_times(plan["online"]), _cpu_times(plan["offline"])
    try:
        result = _rr(lab, seconds, rate, plan["online"])
    finally:
        stop.set()
        if ticker:
            ticker.join()
    after = _cpu_times(plan["online"]), _cpu_times(plan["offline"])
    online, offline = (_delta(b, a) for b, a in zip(before, after))
    result["online_cpu_softirq"] = online["softirq"] / online["all"]
    result["offline_cpus_busy"] = 1 - offline["idle"] / offline["all"]
    if flood is not None:
        out, err = flood.communicate(timeout=seconds + 60)
        if flood.returncode != 0:
            raise TidalError(f"bench net-isolation: flood sender failed: {err.strip()[:200]}")
        result["offline"] = json.loads(out)
    carried = _wire_counters(lab)
    result["wire_drops"] = carried["drops"] - wire["drops"]
    if flood is not None:
        # the flood's frames on the link: all the link carried this way, less online's requests
        frames = carried["bytes"] - wire["bytes"] - result["sent"] * RR_BYTES
        result["offline"]["wire_mbps"] = frames * 8 / result["offline"]["seconds"] / MBIT
    return result


def _cpu_times(cpus) -> Dict[str, float]:
    """Seconds these cpus (all when None) spent in softirq, idle and in all, so far."""
    import psutil

    times = psutil.cpu_times(percpu=True)
    chosen = [times[cpu] for cpu in sorted(cpus)] if cpus else times
    return {"softirq": sum(t.softirq for t in chosen), "idle": sum(t.idle for t in chosen),
            "all": sum(sum(t) for t in chosen)}


def _delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    out = {key: after[key] - before[key] for key in before}
    out["all"] = max(out["all"], 1e-9)
    return out


def _cpu_plan() -> Dict[str, Any]:
    """The same cpu placement in every scenario: the online client and server on the first cpu;
    the flood, the sink and the shaper's loop on the others (Tidal's cpu isolation would keep
    them apart anyway; the sink stands for another machine, which on a 2-cpu host would
    otherwise steal online's cpu)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {"online": None, "offline": None, "note": "one cpu: no placement"}
    return {"online": {cpus[0]}, "offline": set(cpus[1:])}


def run(link_mbps: int = 200, seconds: float = 4.0, repeats: int = 5, rr_rate: float = 500.0,
        pm_qos: bool = True, progress: Callable[[str], None] = lambda line: None) -> Dict[str, Any]:
    """``progress`` gets one line per scenario run (the CLI prints them on stderr)."""
    if os.geteuid() != 0:
        raise TidalError("bench net-isolation needs root: it makes network namespaces and cgroups")
    from agent.isolation.cgroups.detect import detect
    from agent.isolation.net.policy import NetConfig, NicRole
    from agent.isolation.net.shaper import NetShaper
    from agent.topology import HostFS

    unified = detect(HostFS("/")).unified
    if unified is None:
        raise TidalError("bench net-isolation needs a cgroup2 hierarchy (the classifier matches sockets by it)")
    group = os.path.join(unified, f"tidal-bench-{uuid.uuid4().hex[:8]}")
    offline_dir = os.path.join(group, "reclaimed")
    os.makedirs(offline_dir)
    link = link_mbps * MBIT
    samples: Dict[str, List[float]] = {name: [] for name in SCENARIOS}
    forward: Dict[str, List[float]] = {name: [] for name in SCENARIOS}
    drops: Dict[str, int] = {name: 0 for name in SCENARIOS}
    offline_mbps: Dict[str, List[float]] = {name: [] for name in SCENARIOS[1:]}
    offline_wire_mbps: Dict[str, List[float]] = {name: [] for name in SCENARIOS[1:]}
    lost: Dict[str, int] = {name: 0 for name in SCENARIOS}
    softirq: Dict[str, List[float]] = {name: [] for name in SCENARIOS}
    round_p99: Dict[str, List[float]] = {name: [] for name in SCENARIOS}
    busy: Dict[str, List[float]] = {name: [] for name in SCENARIOS}
    classifier = None
    plan = _cpu_plan()
    mine = os.sched_getaffinity(0)
    pm = {"held": False, "reason": "--no-pm-qos"}
    try:
        if plan["offline"]:
            os.sched_setaffinity(0, plan["offline"])  # the shaper's loop runs where the agent would: not online's cpu
        with contextlib.ExitStack() as stack:
            if pm_qos:
                pm = stack.enter_context(WakeupLatencyHold(0)).describe()
            lab = stack.enter_context(NetLab(dual=False, wire_rate=link, single_segment=True, far_cpus=plan["offline"]))
            lab.server(lab.peer, ["sink", SERVICE, "5001"], cpus=plan["offline"])
            lab.server(lab.peer, ["echo", SERVICE, "5002"], cpus=plan["online"])
            for round_no in range(1, repeats + 1):
                for scenario in SCENARIOS:
                    progress(f"net-isolation: round {round_no}/{repeats}, {scenario} ({seconds:g} s)")
                    shaper = None
                    if scenario.startswith("tidal"):
                        shaper = NetShaper(NetConfig(NicRole("a0", link), netns=lab.host, window=2.0),
                                           offline_dir=offline_dir, cgroup2_root=unified)
                        shaper.setup()
                        classifier = shaper.classifier.describe()
                        if shaper.classifier.kind == "none":
                            shaper.revert()
                            raise TidalError(f"bench net-isolation: no classifier: {shaper.classifier.reason}")
                    try:
                        flood = False if scenario == "unloaded" else (offline_dir if shaper else None)
                        result = _round(lab, seconds, rr_rate, flood, plan, shaper, flood_idle=scenario == "tidal")
                    finally:
                        if shaper is not None:
                            shaper.revert()
                    samples[scenario].extend(result["samples_us"])
                    round_p99[scenario].append(round(percentile(result["samples_us"], 99), 1))
                    forward[scenario].extend(result["forward_us"])
                    drops[scenario] += result["wire_drops"]
                    lost[scenario] += result["lost"]
                    softirq[scenario].append(result["online_cpu_softirq"])
                    busy[scenario].append(result["offline_cpus_busy"])
                    if scenario != "unloaded":
                        offline_mbps[scenario].append(result["offline"]["mbps"])
                        offline_wire_mbps[scenario].append(result["offline"]["wire_mbps"])
    finally:
        os.sched_setaffinity(0, mine)
        for directory in (offline_dir, group):
            try:
                os.rmdir(directory)
            except OSError:
                pass
    online_mbps = rr_rate * RR_BYTES * 8 / MBIT  # each direction
    unloaded = {"p50_us": round(percentile(samples["unloaded"], 50), 1),
                "p99_us": round(percentile(samples["unloaded"], 99), 1), "lost": lost["unloaded"],
                "p99_us_by_round": round_p99["unloaded"],
                "over_1ms": round(sum(s > 1000 for s in samples["unloaded"]) / len(samples["unloaded"]), 4),
                "forward_p99_us": round(percentile(forward["unloaded"], 99), 1),
                "online_cpu_softirq": round(median(softirq["unloaded"]), 4),
                "offline_cpus_busy": round(median(busy["unloaded"]), 3)}
    scenarios = {}
    for name in SCENARIOS[1:]:
        p99 = percentile(samples[name], 99)
        mbps, wire_mbps = median(offline_mbps[name]), median(offline_wire_mbps[name])
        left = link_mbps - online_mbps
        scenarios[name] = {"p50_us": round(percentile(samples[name], 50), 1), "p99_us": round(p99, 1),
                           "p99_us_by_round": round_p99[name],
                           "p99_ratio": round(p99 / unloaded["p99_us"], 3), "lost": lost[name],
                           "forward_p99_us": round(percentile(forward[name], 99), 1),
                           "over_1ms": round(sum(s > 1000 for s in samples[name]) / len(samples[name]), 4),
                           "wire_drops": drops[name], "online_cpu_softirq": round(median(softirq[name]), 4),
                           "offline_cpus_busy": round(median(busy[name]), 3),
                           "offline_mbps": round(mbps, 2), "offline_wire_mbps": round(wire_mbps, 2),
                           "offline_share": round(wire_mbps / left, 3),
                           "offline_goodput_share": round(mbps / left, 3)}
    return {"link_mbps": link_mbps, "unloaded": unloaded, "scenarios": scenarios,
            "targets": {"tidal_p99_ratio_max": 1.5, "tidal_offline_share_min": 0.9},
            "met": scenarios["tidal"]["p99_ratio"] <= 1.5 and scenarios["tidal"]["offline_share"] >= 0.9,
            "classifier": classifier, "pm_qos": pm,
            "offline_cpu_policy": {"tidal": "SCHED_IDLE", "none": "normal", "tidal_shaper_only": "normal"},
            "cpu_plan": {k: sorted(v) if isinstance(v, set) else v for k, v in plan.items()}, "seconds": seconds, "repeats": repeats, "rr_rate": rr_rate,
            "samples": {k: len(v) for k, v in samples.items()}}

"""What ``tidal status`` prints: the agent's status document as lines a person reads."""

from __future__ import annotations

from typing import Any, Dict, List


def status_lines(data: Dict[str, Any]) -> List[str]:
    """The summary (cgroups, pools, runtime, memory, cpu and io pressure, policy, conflicts, evictions, push
    targets), then the per-cpu table."""
    out: List[str] = []
    pools_ = data["pools"]
    out.append(f"cgroup v{data['cgroup_version']}, tree {data['cgroup_base']}, {data['workloads']} workloads, "
               f"last reconcile {data['last_reconcile_ms']} ms, drift repairs {data['counters']['drift_repairs']}")
    isolation = data.get("dedicated_isolation") or {}
    if isolation:
        out.append(f"dedicated cores: {isolation['mode']}" + (f" ({isolation['why']})" if isolation.get("why") else ""))
        for path, reason in sorted(isolation.get("refused", {}).items()):
            out.append(f"  {path}: plain cpuset, partition refused: {reason}")
    for name in ("reserved", "shared", "reclaimed", "dedicated"):
        out.append(f"  {name:<10} {pools_[name] or '-'}")
    if pools_.get("held_back"):
        held = ", ".join(f"{h['cpu']} ({h['sibling_of']})" for h in data["smt"]["held_back"])
        out.append(f"  held back  {pools_['held_back']}: SMT siblings of dedicated cpus, no reclaimed work there: {held}")
    runtime = data.get("runtime")
    if runtime and data.get("workloads_by_source", {}).get("kubernetes") or (runtime or {}).get("nri_last_heard_seconds"):
        road = ("the runtime, through Tidal's NRI plugin, at container creation; the agent's own cgroup writes too"
                if runtime["pods_confined_by"] != "kubelet-cgroups" else
                f"the agent's writes of the kubelet's cgroups (NRI plugin: {runtime['nri_plugin']})")
        out.append(f"pods confined by {road}")
    if "online_millicpu" in data:
        declared = ", ".join(f"{c['path']} {'-' if c['millicpu'] is None else str(c['millicpu']) + 'm'}"
                             for c in data.get("offline_cgroups", []))
        out.append(f"online use {data['online_millicpu']}m" + (f"; declared offline: {declared}" if declared else ""))
    memory = data.get("memory")
    if memory:
        gib = lambda n: "-" if n is None else f"{n / 2 ** 30:.1f} GiB"  # noqa: E731
        pressure = memory["online_pressure_percent"]
        out.append(f"memory available {gib(memory['available_bytes'])} of {gib(memory['total_bytes'])} "
                   f"(reclaimed work evicted under {gib(memory['evict_below_bytes'])}); online "
                   f"{gib(memory['online_bytes'])}, reclaimed {gib(memory['reclaimed_bytes'])}; online memory "
                   f"pressure " + ("- (no PSI)" if pressure is None and memory["pressure_scope"] is None else
                                   f"{'-' if pressure is None else f'{pressure:.1f}%'} "
                                   f"({memory['pressure_scope']}; evicts at {memory['pressure_threshold_percent']:g}%)"))
        if memory.get("protected_bytes") is not None:
            out.append(f"online memory protected (memory.low): {gib(memory['protected_bytes'])} in "
                       f"{len(memory['protection'])} cgroups")
        if memory.get("offline_throttled_to_bytes") is not None:
            out.append(f"offline memory THROTTLED to {gib(memory['offline_throttled_to_bytes'])} (online stalled on "
                       f"memory; {memory['pressure_throttles']} cuts so far)")
    cpu = data.get("cpu_pressure")
    if cpu:
        pct = lambda v: "-" if v is None else f"{v:.1f}%"  # noqa: E731
        out.append(("online cpu pressure - (no PSI)" if cpu["scope"] is None else
                    f"online cpu pressure {pct(cpu['online_cpu_percent'])} ({cpu['scope']}; takes lent cpus back at "
                    f"{cpu['threshold_percent']:g}%; {cpu['shrinks']} times so far"
                    + (f"; lending held {cpu['lending_held_periods']} more periods" if cpu["lending_held_periods"]
                       else "") + ")"))
    kernel = data.get("kernel_work")
    if kernel and kernel["confined"]:
        out.append("reclaimed work kept off online's idle cpus (it runs in the kernel): " + ", ".join(
            f"{name} ({kernel['kernel_millicpu'].get(name, '-')} millicpu in the kernel"
            + (f"; nothing lent: waiting at the minimum quota for {kernel['waiting_seconds'][name]:g} s"
               if name in (kernel.get("waiting_seconds") or {}) else "") + ")" for name in kernel["confined"]))
    containers = data.get("offline_containers")
    if containers:
        out.append(f"offline containers: {containers['adopted']} moved into the reclaimed tree, {containers['refused']} "
                   "killed (no room)" + (f"; {containers['unmoved']} NOT MOVED (unbounded in their daemon's cgroup): "
                                         f"{containers['last_attach_error']}" if containers.get("unmoved") else ""))
    io = data.get("io_pressure")
    if io:
        pct = lambda v: "-" if v is None else f"{v:.1f}%"  # noqa: E731
        acts = (f"limits offline io at {io['threshold_percent']:g}%; {io['throttles']} times so far"
                if io["supported"] and io["threshold_percent"] > 0 else
                "shown only: " + ("off" if io["supported"] else "no io controller"))
        out.append("online io pressure - (no PSI)" if io["scope"] is None else
                   f"online io pressure {pct(io['online_io_percent'])} ({io['scope']}; {acts})")
        if io["limits"]:
            from agent.services.io_guard import describe

            out.append("offline io LIMITED: " + describe({d: (v["read_bps"], v["write_bps"])
                                                          for d, v in io["limits"].items()}))
    policy = data.get("policy")
    if policy:
        line = f"cluster policy: {policy['name']} (generation {policy['generation']})"
        if policy["applied"]:
            line += "; sets " + ", ".join(f"{k}={data['settings'][k]['value']}" for k in policy["applied"])
        if policy["kept_local"]:
            line += "; this node's own kept: " + ", ".join(policy["kept_local"])
        if policy["refused"]:
            line += "; refused: " + "; ".join(f"{k}: {why}" for k, why in sorted(policy["refused"].items()))
        out.append(line)
    for kind, why in sorted((data.get("conflicts") or {}).items()):
        out.append(f"CONFLICT ({kind}): {why}")
    causes = {k: v for k, v in (data.get("evictions_by_cause") or {}).items() if v}
    if causes:
        out.append("evictions " + ", ".join(f"{cause} {count}" for cause, count in causes.items()))
    for target in data.get("push", []):
        sent = target.get("last_sent") or {}
        figures = f"{sent['vcores']} vcores, {sent['memory_mb']} MB" if "vcores" in sent else "-"
        line = (f"push {target['kind']} {target['name']}: sent {target['sent']}, failures {target['failures']}, "
                f"last sent {figures}")
        if target.get("node_id"):
            line += f" to node {target['node_id']}" + (" (floored at YARN's minimum)" if target.get("floored") else "")
        if target["consecutive_failures"]:
            line += f"; FAILING: {target['last_error']}"
        out.append(line)
    out.append("")
    rows = [("CPU", "NUMA", "CORE", "POOL", "WORKLOAD", "USAGE")]
    for c in data["cpus"]:
        usage = "-" if c["usage_millicpu"] is None else f"{c['usage_millicpu'] / 10:.0f}%"
        rows.append((str(c["id"]), str(c["numa"]), str(c["core"]), c["pool"], c["workload"] or "-", usage))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.append("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())

    return out

"""Prometheus metrics of the agent (``GET /metrics``), read from its state at scrape time.

A custom collector over the agent (no background updating): pool sizes per
NUMA node, reclaimed capacity, per-workload usage, evictions by tier and cause,
the node's available memory, online memory pressure,
reconcile duration and count, drift repairs, node state.
"""

from __future__ import annotations

import weakref
from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from contracts.states import STATES as NODE_STATES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class AgentCollector(Collector):
    def __init__(self, agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator:
        from agent.qrm.policy import pools

        agent = self.agent
        with agent.lock:
            topo, state = agent.topology, agent.state
            pool = pools(topo, state)
            sizes = GaugeMetricFamily("tidal_pool_cpus", "cpus in each pool, per NUMA node", labels=["pool", "numa"])
            for name in ("reserved", "shared", "reclaimed", "dedicated"):
                members = set(getattr(pool, name))
                for numa in topo.numa_ids():
                    sizes.add_metric([name, str(numa)], len(members & set(topo.cpus_in_numa(numa))))
            yield sizes
            cap = agent.harvest.capacity
            g = GaugeMetricFamily("tidal_reclaimed_capacity_millicpu", "reclaimed cpu offline agents may use")
            g.add_metric([], cap.millicpu if cap else 0)
            yield g
            g = GaugeMetricFamily("tidal_reclaimed_capacity_memory_bytes", "reclaimed memory offline agents may use")
            g.add_metric([], cap.memory_bytes if cap else 0)
            yield g
            g = GaugeMetricFamily("tidal_capacity_generation", "changes of the reported capacity")
            g.add_metric([], agent.harvest.generation)
            yield g
            usage = GaugeMetricFamily("tidal_workload_usage_millicpu", "cpu used by each workload",
                                      labels=["workload", "qos"])
            requested = GaugeMetricFamily("tidal_workload_request_millicpu", "cpu each workload asked for",
                                          labels=["workload", "qos"])
            for alloc in state.allocations:
                labels = [alloc.name, alloc.qos.value]
                requested.add_metric(labels, alloc.millicpu)
                where = agent.cgroups_of(alloc)
                value = agent.usage.by_cgroup.get(where[0]) if where else None
                if value is not None:
                    usage.add_metric(labels, value)
            yield usage
            yield requested
            ev = CounterMetricFamily("tidal_evictions", "reclaimed workloads evicted, by tier", labels=["tier"])
            for tier, count in agent.eviction.by_tier.items():
                ev.add_metric([tier], count)
            yield ev
            ev = CounterMetricFamily("tidal_evictions_by_cause", "workloads evicted, by cause (cpu: over-committed "
                                     "capacity; memory: under the watermark; pressure: online memory stalls; "
                                     "lending: a notice's end)", labels=["cause"])
            for cause, count in agent.eviction.by_cause.items():
                ev.add_metric([cause], count)
            yield ev
            memory = agent.memory_status()
            yield from gauges(memory, (
                ("tidal_memory_available_bytes", "available_bytes", "the node's available memory (MemAvailable)"),
                ("tidal_memory_evict_below_bytes", "evict_below_bytes", "available memory under which reclaimed work is evicted"),
                ("tidal_online_memory_pressure_percent", "online_pressure_percent",
                 "share of the last period some online task stalled on memory (PSI), worst online cgroup"),
                ("tidal_online_memory_protected_bytes", "protected_bytes",
                 "online memory under memory.low (cgroup v2; absent on v1)"),
                ("tidal_offline_memory_bytes", "reclaimed_bytes",
                 "memory offline work holds (the reclaimed tree, declared offline cgroups, reclaimed pods)"),
                ("tidal_offline_memory_throttle_bytes", "offline_throttled_to_bytes",
                 "what offline work may hold while online stalls on memory (absent: not throttled)")))
            cpu = agent.cpu_pressure_status()
            yield from gauges(cpu, (
                ("tidal_online_cpu_pressure_percent", "online_cpu_percent",
                 "share of the last period some online task waited for a cpu (PSI), worst online cgroup"),
                ("tidal_lending_held_periods", "lending_held_periods",
                 "periods before lending may grow again after online's cpu pressure took lent cpus back")))
            c = CounterMetricFamily("tidal_cpu_pressure_shrinks", "lent cpus taken back on online cpu pressure")
            c.add_metric([], cpu["shrinks"])
            yield c
            yield from kernel_work_metrics(agent.harvest.kernel_work)
            yield from offline_container_metrics(agent.containers)
            io = agent.io_pressure_status()
            yield from gauges(io, (("tidal_online_io_pressure_percent", "online_io_percent",
                                    "share of the last period some online task waited for block io (PSI), worst "
                                    "online cgroup"),))
            c = CounterMetricFamily("tidal_io_pressure_throttles", "cuts of offline block io on online io pressure")
            c.add_metric([], io["throttles"])
            yield c
            g = GaugeMetricFamily("tidal_offline_io_limit_bytes_per_second",
                                  "bandwidth limit on offline block io while online waits on io (absent: none)",
                                  labels=["device", "direction"])
            for device, pair in io["limits"].items():
                for direction in ("read", "write"):
                    if pair[f"{direction}_bps"] is not None:
                        g.add_metric([device, direction], pair[f"{direction}_bps"])
            yield g
            c = CounterMetricFamily("tidal_pressure_throttles", "cuts of offline memory on online memory pressure")
            c.add_metric([], memory["pressure_throttles"])
            yield c
            c = CounterMetricFamily("tidal_reconciles", "reconcile passes")
            c.add_metric([], agent.counters["reconciles"])
            yield c
            c = CounterMetricFamily("tidal_drift_repairs", "cgroup files changed by others and repaired")
            c.add_metric([], agent.counters["drift_repairs"])
            yield c
            c = CounterMetricFamily("tidal_reconcile_failures", "cgroup writes the kernel refused")
            c.add_metric([], agent.counters["reconcile_failures"])
            yield c
            g = GaugeMetricFamily("tidal_reconcile_duration_seconds", "duration of the last reconcile pass")
            g.add_metric([], agent.enforcement.last_reconcile_ms / 1000.0)
            yield g
            g = GaugeMetricFamily("tidal_online_usage_millicpu", "online (non-dedicated, non-reclaimed) cpu use")
            g.add_metric([], agent.usage.online_millicpu)
            yield g
            # every family is described even with no series (no push target here): what exists does not
            # depend on the node's configuration, and a dashboard's names are checked against it
            pusher = getattr(agent, "pusher", None)
            records = pusher.records() if pusher is not None else []
            sent = CounterMetricFamily("tidal_push_sent", "capacity pushes an offline system took",
                                       labels=["kind", "target"])
            failed = CounterMetricFamily("tidal_push_failures", "capacity pushes that failed",
                                         labels=["kind", "target"])
            failing = GaugeMetricFamily("tidal_push_failing", "1 while a target's last push failed",
                                        labels=["kind", "target"])
            for r in records:
                sent.add_metric([r["kind"], r["name"]], r["sent"])
                failed.add_metric([r["kind"], r["name"]], r["failures"])
                failing.add_metric([r["kind"], r["name"]], 1 if r["consecutive_failures"] else 0)
            yield sent
            yield failed
            yield failing
            g = GaugeMetricFamily("tidal_node_state", "1 for the node's lending state", labels=["state"])
            for name in NODE_STATES:
                g.add_metric([name], 1 if agent.lending.current.state == name else 0)
            yield g
            yield from self.health(agent)

    @staticmethod
    def health(agent) -> Iterator:
        """What alerts read beyond the counters: the version, the loop's last period, each report's
        freshness, the pressure thresholds in force and conflicts with other node software."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            release = version("tidal")
        except PackageNotFoundError:
            release = "unknown"
        g = GaugeMetricFamily("tidal_build_info", "1, labelled with the agent's version", labels=["version"])
        g.add_metric([release], 1)
        yield g
        g = GaugeMetricFamily("tidal_last_period_timestamp_seconds", "wall clock of the loop's last complete period "
                              "(absent before the first)")
        if agent.last_period_at is not None:
            g.add_metric([], agent.last_period_at)
        yield g
        g = GaugeMetricFamily("tidal_report_timestamp_seconds", "wall clock when each report to the cluster (nrt: "
                              "the NodeResourceTopology object and the node's reclaimed resources) was last known "
                              "current; nodeusage: the pods' use, at each write (absent: never, or not a Kubernetes node)",
                              labels=["report"])
        for report, at in sorted(agent.reports.items()):
            g.add_metric([report], at)
        yield g
        g = GaugeMetricFamily("tidal_pressure_threshold_percent", "the share of time online may stall before "
                              "offline work is cut, per resource (0: that loop is off)", labels=["resource"])
        harvest = agent.harvest
        for resource, value in (("memory", harvest.throttle.threshold), ("cpu", harvest.cpu_loop.threshold),
                                ("io", harvest.io_guard.throttle.threshold)):
            g.add_metric([resource], value)
        yield g
        g = GaugeMetricFamily("tidal_cluster_policy_info", "1, labelled with the cluster policy (TidalPolicy) the node "
                              "follows and its generation (absent: the node's own settings)",
                              labels=["policy", "generation"])
        if agent.policy:
            g.add_metric([str(agent.policy["name"]), str(agent.policy["generation"])], 1)
        yield g
        g = GaugeMetricFamily("tidal_conflict", "1 while other node software conflicts with the agent "
                              "(kubelet_cpu_manager: the kubelet now runs the static CPU manager)", labels=["kind"])
        for kind in ("kubelet_cpu_manager",):
            g.add_metric([kind], 1 if kind in agent.conflicts else 0)
        yield g


_registries: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def kernel_work_metrics(work):
    """The kernel-work rule's families (services.kernel_work): confined now and ever, waiting now and how
    long all waits took."""
    for kind, name, text, value in (
            (GaugeMetricFamily, "tidal_reclaimed_confined_workloads",
             "reclaimed workloads kept off online's idle cpus because they run in the kernel", len(work.confined)),
            (CounterMetricFamily, "tidal_reclaimed_confinements",
             "reclaimed workloads kept off online's idle cpus because they ran in the kernel", work.confinements),
            (GaugeMetricFamily, "tidal_reclaimed_waiting_workloads",
             "reclaimed workloads confined for their kernel time with no lent cpu: waiting at the minimum quota",
             len(work.waiting_since)),
            (CounterMetricFamily, "tidal_reclaimed_kernel_wait_seconds",
             "workload-seconds reclaimed work confined for its kernel time waited at the minimum quota (nothing "
             "lent)", work.waited_seconds)):
        family = kind(name, text)
        family.add_metric([], value)
        yield family


def offline_container_metrics(containers):
    """An offline daemon's container processes (services.offline_containers): moved into the reclaimed tree,
    killed for want of room, or left where the kernel would not move them (unbounded: an alert's figure).
    Described, with no series, where no daemon cgroup is declared (``containers`` None)."""
    c = CounterMetricFamily("tidal_offline_container_processes",
                            "container processes of offline daemons (YARN's NodeManager), by what became of them",
                            labels=["outcome"])
    g = GaugeMetricFamily("tidal_offline_container_processes_unmoved",
                          "container processes the kernel would not move into the reclaimed tree, now")
    if containers is not None:
        for outcome, value in (("moved", containers.adopted), ("killed", containers.refused),
                               ("not_moved", containers.attach_failures)):
            c.add_metric([outcome], value)
        g.add_metric([], len(containers.failing))
    yield c
    yield g


def gauges(figures, rows):
    """A gauge for each (metric name, key of ``figures``, help): its figure where known, no series where
    not (None), the family described either way."""
    for name, key, text in rows:
        g = GaugeMetricFamily(name, text)
        if figures[key] is not None:
            g.add_metric([], figures[key])
        yield g


def render(agent) -> bytes:
    """The agent's metrics in Prometheus' text format (one registry per agent, made once)."""
    registry = _registries.get(agent)
    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(AgentCollector(agent))
        _registries[agent] = registry
    return generate_latest(registry)

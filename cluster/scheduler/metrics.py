"""What the scheduler exports on ``/metrics`` (Prometheus), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class SchedulerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.bound = Counter("tidal_scheduler_pods_bound", "Pods bound to a node by this scheduler.", registry=r)
        self.bind_errors = Counter("tidal_scheduler_bind_errors", "Bindings the API server refused or that failed.",
                                   ["code"], registry=r)
        self.conflicts = Counter("tidal_scheduler_conflicts",
                                 "Placements found stale when committed (another placement took the room first).",
                                 registry=r)
        self.unschedulable = Counter("tidal_scheduler_unschedulable_attempts",
                                     "Attempts that found no room for a unit.", ["kind"], registry=r)
        self.preemptions = Counter("tidal_scheduler_preemptions", "Preemptions started (a node chosen, victims evicted).",
                                   registry=r)
        self.victims = Counter("tidal_scheduler_preemption_victims", "Pods evicted to make room.", ["kind"], registry=r)
        self.gangs = Counter("tidal_scheduler_gangs_placed", "Gangs placed whole.", registry=r)
        self.latency = Histogram("tidal_scheduler_pod_scheduling_seconds",
                                 "From a pod's creation to its binding.", buckets=LATENCY_BUCKETS, registry=r)
        self.attempt = Histogram("tidal_scheduler_unit_attempt_seconds", "One unit's filter, score and commit.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.pending = Gauge("tidal_scheduler_pending_pods", "Pods of this scheduler waiting for a node.", registry=r)
        self.nodes = Gauge("tidal_scheduler_nodes", "Nodes in the scheduler's table.", registry=r)
        self.leader = Gauge("tidal_scheduler_leader", "1 while this replica holds the lease.", registry=r)
        self.dropped = Counter("tidal_scheduler_notices_dropped",
                               "Events and status writes dropped because their queue was full.", registry=r)

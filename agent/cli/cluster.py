"""``tidal cluster``: the extender, the scheduler, the lending controller, the simulator."""

from __future__ import annotations

import os
from typing import Optional

import click

from agent.errors import TidalError
from agent.cli import FiniteRange, _Group, emit_json, main


@main.group(cls=_Group)
def cluster() -> None:
    """The cluster side: simulation (and, with Kubernetes, the extender and the lending controller)."""


KUBECONFIG_OPTION = click.option(
    "--kubeconfig", default=None, type=click.Path(dir_okay=False),
    help="Kubeconfig to use (default: in-cluster service account, then ~/.kube/config).")


def serve_until_stopped(stop) -> None:
    """Block until SIGTERM, Ctrl-C or ``stop`` is set (a server's threads do the work meanwhile)."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass


def kube_rest(kubeconfig: Optional[str], user_agent: str):
    """The lean client (``kube.rest``): the given kubeconfig, else in-cluster (without importing the official
    client), else the default kubeconfig."""
    from kube.rest import connect

    try:
        return connect(kubeconfig, user_agent)
    except (ValueError, OSError) as exc:
        raise TidalError(f"cannot configure a Kubernetes client: {exc}") from None


def kube_client(kubeconfig: Optional[str]):
    """An API client: the given kubeconfig, else in-cluster, else the default kubeconfig."""
    from kubernetes import client, config

    try:
        if kubeconfig:
            return config.new_client_from_config(config_file=kubeconfig)
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            return config.new_client_from_config()
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        raise TidalError(f"cannot configure a Kubernetes client: {exc}") from None


@cluster.command("extender")
@KUBECONFIG_OPTION
@click.option("--port", default=8890, show_default=True, type=click.IntRange(1, 65535))
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Listen address; anything but loopback needs --tls-client-ca (or --insecure).")
@click.option("--tls-cert", default=None, type=click.Path(dir_okay=False), help="Serve HTTPS with this certificate.")
@click.option("--tls-key", default=None, type=click.Path(dir_okay=False), help="The certificate's key.")
@click.option("--tls-client-ca", default=None, type=click.Path(dir_okay=False),
              help="Require client certificates signed by this CA (kube-scheduler's tlsConfig.certFile/keyFile).")
@click.option("--insecure", is_flag=True,
              help="Listen beyond loopback without client certificates: filter and prioritize answer anyone; "
                   "bind is refused (it needs a client certificate off loopback).")
@click.option("--policy", default="pack", show_default=True, type=click.Choice(["pack", "spread"]))
@click.option("--stale-after", default=120.0, show_default=True, type=FiniteRange(1, 86400),
              help="Seconds after which a node's topology report is not trusted.")
def cluster_extender(kubeconfig, port: int, address: str, tls_cert, tls_key, tls_client_ca, insecure: bool,
                     policy: str, stale_after: float) -> None:
    """Serve the kube-scheduler extender (filter, prioritize, bind) from the nodes' topology reports."""
    import ipaddress
    import threading

    from cluster.extender import NrtWatcher, TopologyCache, serve, tls_context

    if (tls_cert is None) != (tls_key is None) or (tls_client_ca and tls_cert is None):
        raise TidalError("--tls-cert and --tls-key go together, and --tls-client-ca needs them")
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = address == "localhost"
    if not loopback and not tls_client_ca and not insecure:
        raise TidalError(f"--address {address}: beyond loopback the extender (which binds pods) needs "
                         f"--tls-cert/--tls-key/--tls-client-ca, or --insecure to accept any caller")
    tls = tls_context(tls_cert, tls_key, tls_client_ca) if tls_cert else None
    api = kube_client(kubeconfig)
    stop = threading.Event()
    cache = TopologyCache(stale_after=stale_after, policy=policy)
    watcher = NrtWatcher(cache, api, stop)
    watcher.check_crd()
    watcher.start()
    server = serve(cache, port, address, api_client=api, tls=tls, bind_needs_certificate=not loopback)
    click.echo(f"tidal extender: serving {'https' if tls else 'http'}://{address}:{port} (filter, prioritize, bind)"
               f"{'; client certificates required' if tls_client_ca else ''}; policy {policy}")
    serve_until_stopped(stop)
    server.shutdown()


@cluster.command("scheduler")
@KUBECONFIG_OPTION
@click.option("--scheduler-name", default="tidal-scheduler", show_default=True,
              help="Schedule the pods whose spec.schedulerName is this.")
@click.option("--policy", default="pack", show_default=True, type=click.Choice(["pack", "spread"]),
              help="pack: best fit (fewest nodes used); spread: the freest node.")
@click.option("--shards", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Scheduler instances, each trying its own share of the nodes first (conflicts resolved "
                   "when a placement is committed).")
@click.option("--bind-workers", default=32, show_default=True, type=click.IntRange(1, 1024),
              help="Bindings in flight at once (over all binding processes).")
@click.option("--bind-processes", default=None, type=click.IntRange(0, 64),
              help="Worker processes that make the bindings (0: threads of this process) [default: a quarter "
                   "of the cpus, 0 on 2 or 3].")
@click.option("--batch", default=256, show_default=True, type=click.IntRange(1, 100_000),
              help="Identical pods (same template, in queue order) placed in one pass.")
@click.option("--fair", is_flag=True, help="Namespaces take turns among units of the same priority.")
@click.option("--no-preemption", is_flag=True, help="Never evict pods to make room.")
@click.option("--pod-initial-backoff", default=1.0, show_default=True, type=FiniteRange(0, 3600),
              help="Seconds a pod that fit nowhere waits before its next try (doubling each try), as "
                   "kube-scheduler's podInitialBackoffSeconds.")
@click.option("--pod-max-backoff", default=10.0, show_default=True, type=FiniteRange(0, 3600),
              help="The most seconds between tries of a pod that fits nowhere (kube-scheduler's "
                   "podMaxBackoffSeconds).")
@click.option("--stale-after", default=120.0, show_default=True, type=FiniteRange(1, 10 ** 7),
              help="Seconds after which a node's topology report is not trusted for NUMA-bound pods.")
@click.option("--leader-elect/--no-leader-elect", default=True, show_default=True,
              help="Schedule only while holding the Lease (replicas wait warm).")
@click.option("--lease-namespace", default="kube-system", show_default=True)
@click.option("--lease-name", default="tidal-scheduler", show_default=True)
@click.option("--metrics-port", default=10259, show_default=True, type=click.IntRange(0, 65535),
              help="Serve /metrics here (0: not at all).")
@click.option("--metrics-address", default="0.0.0.0", show_default=True)
def cluster_scheduler(kubeconfig, scheduler_name: str, policy: str, shards: int, bind_workers: int, bind_processes,
                      batch: int,
                      fair: bool, no_preemption: bool, pod_initial_backoff: float, pod_max_backoff: float,
                      stale_after: float, leader_elect: bool, lease_namespace: str,
                      lease_name: str, metrics_port: int, metrics_address: str) -> None:
    """Schedule pods (alone or in gangs) on the nodes' reports: NUMA-true, preempting reclaimed work."""
    import logging
    import signal
    import threading

    from cluster.scheduler.service import Scheduler

    if pod_initial_backoff > pod_max_backoff:
        raise TidalError(f"--pod-initial-backoff {pod_initial_backoff:g} is above --pod-max-backoff "
                         f"{pod_max_backoff:g}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rest = kube_rest(kubeconfig, "tidal-scheduler")
    if bind_processes is None:
        bind_processes = min(8, (os.cpu_count() or 1) // 4)
    scheduler = Scheduler(rest, scheduler_name, policy, shards, bind_workers, stale_after, batch, fair,
                          not no_preemption, bind_processes, backoff=(pod_initial_backoff, pod_max_backoff))
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, metrics_address, registry=scheduler.metrics.registry)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # from here: a standby replica waits for the Lease
    lost = threading.Event()

    def on_lost() -> None:  # another replica may lead now: stop placing, and exit so the pod restarts
        scheduler._lost()
        lost.set()
        stop.set()

    try:
        scheduler.start(leader_elect, lease_namespace, lease_name, on_lost=on_lost)
    except TimeoutError as exc:
        raise TidalError(str(exc)) from None
    click.echo(f"tidal scheduler: {scheduler_name}, {len(scheduler.table)} nodes, policy {policy}, {shards} "
               f"shard(s){', leader election on ' + lease_namespace + '/' + lease_name if leader_elect else ''}",
               err=True)
    serve_until_stopped(stop)
    scheduler.close()
    if lost.is_set():
        raise TidalError("leader election lost: another replica may be scheduling; exiting")


@cluster.command("metrics")
@KUBECONFIG_OPTION
@click.option("--port", default=8443, show_default=True, type=click.IntRange(1, 65535))
@click.option("--address", default="0.0.0.0", show_default=True, help="Listen address.")
@click.option("--tls-cert", required=True, type=click.Path(dir_okay=False), help="Serve HTTPS with this certificate.")
@click.option("--tls-key", required=True, type=click.Path(dir_okay=False), help="The certificate's key.")
@click.option("--client-ca", default=None, type=click.Path(dir_okay=False),
              help="Require client certificates signed by this CA [default: the API server's front-proxy CA, "
                   "from the kube-system/extension-apiserver-authentication ConfigMap].")
@click.option("--insecure", is_flag=True,
              help="Serve callers without a client certificate when the API server publishes no front-proxy CA "
                   "(anyone who reaches the port reads every pod's use).")
@click.option("--stale-after", default=60.0, show_default=True, type=FiniteRange(1, 86400),
              help="Seconds after which a node's NodeUsage report is not served (its pods' metrics missing).")
def cluster_metrics(kubeconfig, port: int, address: str, tls_cert: str, tls_key: str, client_ca, insecure: bool,
                    stale_after: float) -> None:
    """Serve the resource metrics API (metrics.k8s.io: the HPA, kubectl top) from the agents' NodeUsage reports,
    in place of metrics-server."""
    import threading

    from cluster.podmetrics import TidalMetrics, front_proxy, name_check, require_front_proxy, tls_context
    from contracts import nodeusage
    from kube.crd import check_crd
    from kube.rest import ApiError

    context = tls_context(tls_cert, tls_key)
    allowed = []
    ca_pem = None
    if client_ca:
        try:
            with open(client_ca) as handle:
                ca_pem = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise TidalError(f"--client-ca {client_ca}: {getattr(exc, 'strerror', None) or exc}") from None
    rest = kube_rest(kubeconfig, "tidal-metrics")
    if ca_pem is None:
        try:
            ca_pem, allowed = front_proxy(rest)
        except ApiError as exc:
            raise TidalError(f"cannot read the API server's front-proxy CA (kube-system/extension-apiserver-"
                             f"authentication): {exc.status} {' '.join(exc.message.split())[:200]}; give "
                             f"--client-ca") from None
        except Exception as exc:  # noqa: BLE001 - the API server unreachable: one line
            raise TidalError(f"cannot reach the API server: {exc}") from None
        if ca_pem is None and not insecure:
            raise TidalError("the API server publishes no front-proxy CA (--requestheader-client-ca-file): give "
                             "--client-ca, or --insecure to serve any caller")
    if ca_pem:
        require_front_proxy(context, ca_pem)
    check_crd(lambda: rest.json("GET", f"/apis/{nodeusage.GROUP}/{nodeusage.VERSION}/{nodeusage.PLURAL}?limit=1"),
              TidalError, missing=f"cannot list NodeUsage objects ({nodeusage.PLURAL}.{nodeusage.GROUP}): 404 "
                                  f"(not installed); kubectl apply -f deploy/crd-nodeusage.yaml",
              what=f"NodeUsage objects ({nodeusage.PLURAL}.{nodeusage.GROUP})")
    metrics = TidalMetrics(stale_after=stale_after)
    stop = threading.Event()
    metrics.watch(rest, stop)
    try:
        bound = metrics.serve(context, address, port,
                              authorize=name_check(allowed) if ca_pem else None)
    except OSError as exc:
        raise TidalError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
    click.echo(f"tidal metrics: serving metrics.k8s.io on https://{address}:{bound} from NodeUsage reports; "
               + ("client certificates of the front proxy required" if ca_pem else "ANY caller served (--insecure)"))
    serve_until_stopped(stop)
    metrics.stop()


@cluster.command("lending")
@KUBECONFIG_OPTION
@click.option("--threshold", default=0.9, show_default=True, type=FiniteRange(0.01, 1.0),
              help="Online water level (requested / allocatable cpu) under which machines are lent.")
@click.option("--online-window", "windows", multiple=True, metavar="HH:MM-HH:MM",
              help="A time of day when every lent machine comes back (repeatable).")
@click.option("--period", default=30.0, show_default=True, type=FiniteRange(1, 3600))
@click.option("--once", is_flag=True, help="One step, then exit.")
@click.option("--dry-run", is_flag=True, help="Print what it would do; change nothing.")
def cluster_lending(kubeconfig, threshold: float, windows, period: float, once: bool, dry_run: bool) -> None:
    """Lend whole machines to offline work while online's water level is low; take them back."""
    import time as _time

    from cluster.lending import LendingController

    controller = LendingController(kube_client(kubeconfig), threshold, list(windows), dry_run, echo=click.echo)
    while True:
        level = controller.observe()
        click.echo(f"water level {level.value:.1%} over {len(level.online_nodes)} online node(s); "
                   f"{len(level.lent_nodes)} lent")
        controller.step()
        if once:
            return
        _time.sleep(period)


@cluster.command("simulate")
@click.option("--nodes", default=1000, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--cores", default=64, show_default=True, type=click.IntRange(1, 4096), help="Cores per node.")
@click.option("--hours", default=24.0, show_default=True, type=FiniteRange(1 / 60, 24 * 14))
@click.option("--buffer", default=0.2, show_default=True, type=FiniteRange(0, 10),
              help="Safety buffer on online's recent peak (the agents' headroom rule).")
@click.option("--offline-demand", default=0.6, show_default=True, type=FiniteRange(0, 10),
              help="Offline work arriving, as a share of the cluster's cores.")
@click.option("--online-peak", default=0.35, show_default=True, type=FiniteRange(0.001, 1),
              help="Online demand at the evening peak, as a share of the cluster's cores.")
@click.option("--no-lending", is_flag=True, help="Colocate on every node but never lend whole machines.")
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="Replay a CSV trace (minute,kind,name,cores,duration_min,tier,node) instead of the synthetic day.")
@click.option("--seed", default=1, show_default=True, type=int)
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False),
              help="Write a PNG of utilisation over the day for both modes.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def cluster_simulate(nodes, cores, hours, buffer, offline_demand, online_peak, no_lending, trace_path, seed,
                     plot_path, as_json) -> None:
    """A day of a cluster: separate online/offline pools vs Tidal's colocation and lending."""
    from cluster import simulate as sim

    config = sim.SimConfig(nodes=nodes, cores=cores, hours=hours, buffer=buffer, seed=seed,
                           offline_demand_share=offline_demand, online_peak_share=online_peak,
                           lending=not no_lending)
    trace = sim.read_trace(trace_path, nodes) if trace_path else None
    if not as_json:
        click.echo(f"simulating {nodes} nodes x {cores} cores for {hours:g} h ...", err=True)
    result = sim.simulate(config, trace)
    if plot_path:
        sim.plot(result, plot_path)
    result.pop("_series")
    if as_json:
        emit_json(result)
        return
    for mode in ("separate", "tidal"):
        r = result[mode]
        click.echo(f"{mode:<9} avg util {r['avg_util'] * 100:5.1f}%  online shortfall "
                   f"{r['online_shortfall_core_hours']:.3f} core-h  offline {r['offline_core_hours']:.0f} core-h  "
                   f"evictions {sum(r['evictions_by_tier'].values())}")
    click.echo(f"gain: {result['gain'] * 100:+.1f} points of utilisation" + (f"; plot: {plot_path}" if plot_path else ""))

"""``tidal``: the operators' command line.

Every expected failure (``TidalError``) becomes one line on stderr,
``tidal: error: <what, naming the file or field>``, and exit code 2; usage
errors are click's (also exit 2). Commands import their layers lazily so
``tidal --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Any, Optional
from urllib.parse import quote

import click

from agent.errors import TidalError


class _Group(click.Group):
    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Usage mistakes too are one ``tidal: error:`` line and exit 2 (click's own form is a
        usage block and an error line); ``--help`` and successful commands are click's."""
        kwargs["standalone_mode"] = False
        # `tidal` however it was started (the entry point, python -m agent.cli): its usage lines, and the
        # shell completion's variable (_TIDAL_COMPLETE=bash_source tidal)
        kwargs.setdefault("prog_name", "tidal")
        kwargs.setdefault("complete_var", "_TIDAL_COMPLETE")
        try:
            code = super().main(*args, **kwargs)
        except click.ClickException as exc:
            click.echo(f"tidal: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("tidal: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TidalError as exc:
            click.echo(f"tidal: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except UnicodeDecodeError as exc:  # an input file that is not UTF-8 text
            click.echo(f"tidal: error: input is not UTF-8 text (byte {exc.start}: {exc.reason})", err=True)
            ctx.exit(2)
        except RecursionError:  # JSON (or another input) nested deeper than Python parses
            click.echo("tidal: error: input nested too deeply", err=True)
            ctx.exit(2)


class FiniteRange(click.FloatRange):
    """click's FloatRange, refusing nan and inf (which compare false to every bound and pass it)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


ROOT_DIR_OPTION = click.option(
    "--shapes", "shapes_dir", default=None, type=click.Path(file_okay=False),
    help="Captured trees to make nodes of: a directory of sysfs trees (tidal topology --capture), or of "
         "hwloc's *.tar.bz2 test trees (default: tests/fixtures/hwloc of this checkout).")


def _captured_trees(directory: Optional[str]) -> dict:
    """``{name: root}`` of the machines under ``directory`` (archives extracted into a temporary dir)."""
    import glob
    import subprocess
    import tempfile

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    directory = directory or os.path.join(here, "tests", "fixtures", "hwloc")
    if not os.path.isdir(directory):
        raise TidalError(f"--shapes {directory}: no such directory")
    roots = {}
    archives = sorted(glob.glob(os.path.join(directory, "*.tar.bz2")))
    if archives:
        work = tempfile.mkdtemp(prefix="tidal-shapes-")
        for archive in archives:
            name = os.path.basename(archive)[:-len(".tar.bz2")]
            expected = archive[:-len(".tar.bz2")] + ".expected.json"
            subprocess.run(["tar", "-xjf", archive, "-C", work], check=True)
            root = json.load(open(expected))["root"] if os.path.exists(expected) else name
            roots[name] = os.path.join(work, root)
    else:
        for entry in sorted(os.listdir(directory)):
            if os.path.isdir(os.path.join(directory, entry, "sys")):
                roots[entry] = os.path.join(directory, entry)
    if not roots:
        raise TidalError(f"--shapes {directory}: no captured trees (*.tar.bz2 or directories with sys/)")
    return roots


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tidal", prog_name="tidal")
def main() -> None:
    """Tidal: colocate online services and offline batch work on one node."""


ROOT_OPTION = click.option(
    "--root", default="/", show_default=True, type=click.Path(file_okay=False),
    help="Root of the sysfs/procfs tree to read (a captured tree for tests).")


@main.command()
@ROOT_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the JSON contract instead of a table.")
@click.option("--capture", metavar="DIR", default=None,
              help="Also copy the sysfs/procfs files discovery read into DIR (new or empty), a tree "
                   "that --root reads back to the same answer (NVML's details excepted).")
def topology(root: str, as_json: bool, capture: Optional[str]) -> None:
    """Show the node's sockets, NUMA nodes, L3 groups, cores, threads, GPUs and NICs."""
    from agent.topology import HostFS, discover
    from agent.topology.render import render_topology

    if capture is not None:
        from agent.topology.capture import RecordingFS, write_capture

        recording = RecordingFS(root)
        topo = discover(recording)
        written = write_capture(recording, capture)
        click.echo(f"tidal: captured {written} entries under {capture}", err=True)
    else:
        topo = discover(HostFS(root))
    if as_json:
        emit_json(topo.to_dict())
    else:
        click.echo(render_topology(topo))
    for warning in topo.warnings if as_json else ():
        click.echo(f"tidal: warning: {warning}", err=True)


@main.command()
@ROOT_OPTION
@click.option("--reserved-cpus", default=None, metavar="LIST",
              help="cpus of the system_cores pool, e.g. 0,8 (default: the first physical core).")
@click.option("--reclaim-cpus", default=None, type=click.IntRange(min=0), metavar="N",
              help="size of the reclaim pool (default: everything the shared pool does not need).")
@click.option("--requests", "requests_file", required=True, type=click.File("r"),
              help="JSON list of requests, processed in order ('-' for stdin).")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def plan(root: str, reserved_cpus, reclaim_cpus, requests_file, as_json: bool) -> None:
    """Dry run: how the QoS manager would place REQUESTS on the node at ROOT."""
    from agent.qrm.plan import plan_report, render_plan, run_plan
    from agent.qrm.policy import initial_state
    from agent.qrm.requests import parse_requests
    from agent.topology import HostFS, discover

    topo = discover(HostFS(root))
    reserved = parse_cpulist_option("--reserved-cpus", reserved_cpus)
    requests = parse_requests(requests_file.read(), requests_file.name)
    state = initial_state(topo, reserved, reclaim_cpus)
    state, rejected = run_plan(topo, state, requests)
    if as_json:
        emit_json(plan_report(topo, state, rejected))
    else:
        click.echo(render_plan(topo, state, rejected))


def parse_cpulist_option(option: str, value):
    if value is None:
        return None
    from agent.topology.parse import parse_cpulist

    try:
        cpus = parse_cpulist(value)
    except ValueError as exc:
        raise TidalError(f"{option}: {exc}") from None
    if not cpus:
        raise TidalError(f"{option}: empty cpu list")
    return cpus


SOCKET_OPTION = click.option(
    "--socket", "socket_path", default=lambda: os.environ.get("TIDAL_SOCKET", "/run/tidal/tidal.sock"),
    show_default="$TIDAL_SOCKET or /run/tidal/tidal.sock", help="Unix socket of the agent's local API.")


def parse_reserved(value: Optional[str]):
    """``--reserved-cpus``: a cpu list, or ``none`` for no reserved pool."""
    if value is not None and value.strip().lower() == "none":
        return ()
    return parse_cpulist_option("--reserved-cpus", value)


@main.command()
@ROOT_OPTION
@SOCKET_OPTION
@click.option("--state-dir", default="/var/lib/tidal", show_default=True, type=click.Path(file_okay=False),
              help="Where the checkpoint is kept.")
@click.option("--reserved-cpus", default=None, metavar="LIST|none",
              help="cpus of the system_cores pool (default: the first physical core).")
@click.option("--period", default=1.0, show_default=True, type=FiniteRange(0.01, 3600),
              help="Seconds between reconcile loops (usage sampling, pool resizing, drift repair).")
@click.option("--tcp-port", default=None, type=click.IntRange(1, 65535),
              help="Also serve on 127.0.0.1:PORT: read-only (health, capacity, metrics, status) without a token.")
@click.option("--tcp-token-file", default=None, type=click.Path(dir_okay=False),
              help="With --tcp-port: a root-owned 0600 file whose token (Authorization: Bearer) allows writes.")
@click.option("--socket-group", default=None, metavar="GROUP",
              help="Let this group's members use the socket (0660) for their own workloads and processes.")
@click.option("--max-workloads-per-user", default=64, show_default=True, type=click.IntRange(0, 100000),
              help="Workloads one non-root user (a --socket-group member) may hold at once.")
@click.option("--plugin-socket", default=None, metavar="PATH",
              help="Also serve the NRI plugin a read-only socket here (mode 0600, owned by --plugin-uid), with "
                   "connection slots kept for it; only its callers may say the plugin is registered. Put it in a "
                   "directory of its own, the only one the plugin's container mounts.")
@click.option("--plugin-uid", default=0, show_default=True, type=click.IntRange(0, 2 ** 31 - 1), metavar="UID",
              help="With --plugin-socket: the uid that owns it (the NRI plugin's).")
@click.option("--cgroup-base", default="tidal", show_default=True, help="Name of Tidal's cgroup tree.")
@click.option("--cgroup-parent", default="/", show_default=True, type=click.Choice(["/", "self"]),
              help="Create the tree at each hierarchy's root, or under the agent's own cgroup (delegation).")
@click.option("--dedicated-partition", default="root", show_default=True, type=click.Choice(["root", "isolated", "none"]),
              help="cgroup v2: make each dedicated workload a cpuset partition (its cpus leave everyone else's "
                   "load balancing; Linux >= 6.7), or plain cpusets (none). Falls back to plain cpusets where "
                   "the kernel refuses; `tidal status` says which.")
@click.option("--no-resize", is_flag=True, help="Keep the reclaim pool at its maximum instead of sizing it from usage.")
@click.option("--revert", is_flag=True, help="On exit, put the kernel back as the agent found it.")
@click.option("--push-command", default=None, metavar="JSON-ARGV",
              help='Run this argument vector on every capacity change, e.g. \'["/usr/local/bin/report", "--node", "n1"]\'.')
@click.option("--push-url", default=None, help="POST the capacity (YARN shape) to this URL on every change.")
@click.option("--push-format", default="yarn", show_default=True, type=click.Choice(["tidal", "yarn", "mesos", "mesos-array"]),
              help="The shape --push-command gets on stdin and --push-url is POSTed.")
@click.option("--push-resend", default=10.0, show_default=True, type=FiniteRange(0, 3600),
              help="Seconds between re-sends of an unchanged capacity to every push target (0: only on change); "
                   "a restarted ResourceManager or NodeManager has forgotten it.")
@click.option("--yarn-rm", default=None, metavar="URL",
              help="Set this node's resource in a YARN ResourceManager (its web address, e.g. http://rm:8088) "
                   "on every change and every --push-resend; never below the RM's minimum allocation.")
@click.option("--yarn-node-id", default=None, metavar="HOST:PORT",
              help="With --yarn-rm: the NodeManager's id (default: found in the RM's node list by host name).")
@click.option("--yarn-node-host", default=None, metavar="NAME",
              help="With --yarn-rm: the NodeManager's host name as the RM lists it (default: this host's names).")
@click.option("--offline-cgroup", "offline_cgroups", multiple=True, metavar="PATH",
              help="A cgroup outside Tidal's tree (from the hierarchy's root, e.g. /hadoop-yarn) whose cpu and "
                   "memory are offline work's, not online demand. Repeatable; may not exist yet.")
@click.option("--yarn-nodemanager-cgroup", "nm_cgroups", multiple=True, metavar="PATH",
              help="A YARN NodeManager's own cgroup (from the hierarchy's root, e.g. /hadoop-yarn; start it there "
                   "with `tidal run --offline-cgroup PATH -- yarn nodemanager`): offline like --offline-cgroup, never "
                   "evicted; every container it launches is moved into Tidal's reclaimed tree, where lending, "
                   "capacity and memory stop them and leave the NodeManager running. Repeatable.")
@click.option("--yarn-container-tier", default="low", show_default=True, type=click.Choice(["high", "min", "low"]),
              help="The eviction tier of YARN containers (--yarn-nodemanager-cgroup).")
@click.option("--eviction-grace", default=10.0, show_default=True, type=FiniteRange(0, 3600),
              help="Seconds over-committed reclaimed work is throttled before whole workloads are evicted.")
@click.option("--memory-evict-below", default=None, metavar="SIZE",
              help="Evict reclaimed work (by tier, the largest first) when the node's available memory falls "
                   "under this, e.g. 512Mi or 1Gi (default: 2% of memory, 256Mi to 2Gi; above the kubelet's "
                   "100Mi, so offline work goes first).")
@click.option("--memory-pressure-threshold", default=20.0, show_default=True, type=FiniteRange(0, 100),
              help="When online tasks stall on memory this share of the time (percent, PSI of the online "
                   "cgroups), cut offline memory to 90% of what it holds at once (v2: memory.high; both: the "
                   "reported capacity), and evict one reclaimed workload per --eviction-grace while it lasts (0: off).")
@click.option("--cpu-pressure-threshold", default=20.0, show_default=True, type=FiniteRange(0, 100),
              help="When online tasks wait for a cpu this share of the time (percent, PSI of the online cgroups, "
                   "over 250 ms) while cpus are lent, take every lent cpu back at once and hold lending (30 "
                   "periods, longer each time it recurs) (0: off).")
@click.option("--io-pressure-threshold", default=20.0, show_default=True, type=FiniteRange(0, 100),
              help="When online tasks wait on block io this share of the time (percent, PSI of the online cgroups, "
                   "over 250 ms), limit offline work's bandwidth on each device it used to half its rate, halving "
                   "again while it lasts (at least 1 MiB/s), and double it back per quiet period (0: off).")
@click.option("--reclaim-buffer", default=0.2, show_default=True, type=FiniteRange(0, 4),
              help="Headroom kept for online above its recent peak, as a fraction of it: the reclaimed capacity "
                   "and the reclaim pool leave online its peak times (1 + this).")
@click.option("--lending-notice", default="60s", show_default=True, metavar="DURATION",
              help="With --kube-node: the notice of lending and reclaim that the node's label asks for.")
@click.option("--online-policy", default="wait", show_default=True, type=click.Choice(["wait", "evict"]),
              help="Lending: wait for online workloads to finish, or evict them when the notice ends.")
@click.option("--hook", "hooks", multiple=True, metavar="STATE=JSON-ARGV",
              help='Run an argument vector on entering a node state, e.g. Offline=\'["/usr/local/bin/on-lent"]\'.')
@click.option("--guard-interval", default=0.05, show_default=True, type=FiniteRange(0, 10),
              help="Seconds between the fast guard's checks of online saturation (0: off; the period still acts).")
@click.option("--no-confine-self", is_flag=True,
              help="Do not move the agent itself into the system pool (the reserved cpus).")
@click.option("--record-cgroups", is_flag=True,
              help="Keep cgroup writes in memory instead of applying them (dry run; tests off the host).")
@click.option("--online-nic", default=None, metavar="NAME:RATE",
              help="Shape this NIC's traffic (online first), with its link rate, e.g. eth0:10gbit.")
@click.option("--offline-nic", default=None, metavar="NAME:RATE",
              help="Send offline traffic through this second NIC (policy routing; falls back to the online NIC).")
@click.option("--offline-gateway", default=None, metavar="IP",
              help="Next hop of offline traffic on the offline NIC (default: that NIC's default route).")
@click.option("--net-netns", default=None, metavar="NAME",
              help="Shape NICs of this network namespace (/run/netns/NAME) instead of the agent's own.")
@click.option("--no-ingress-shaping", is_flag=True, help="Shape outgoing traffic only (no IFB devices).")
@click.option("--kube-node", default=None, metavar="NAME",
              help="Run as this Kubernetes node's agent: pods from the API server, NRT reports, lending by label.")
@click.option("--kubeconfig", default=None, type=click.Path(dir_okay=False),
              help="With --kube-node: kubeconfig (default: in-cluster service account).")
@click.option("--kubelet-root-dir", default="/var/lib/kubelet", show_default=True, type=click.Path(file_okay=False),
              help="With --kube-node: the kubelet's root directory, whose cpu_manager_state says its CPU manager "
                   "policy (the agent refuses to run beside the static policy).")
@click.option("--kubelet-cgroup-driver", default=None, type=click.Choice(["cgroupfs", "systemd"]),
              help="With --kube-node: the kubelet's cgroup driver (default: detected).")
@click.option("--topology-policy", default="none", show_default=True,
              type=click.Choice(["none", "best-effort", "restricted", "single-numa-node"]),
              help="With --kube-node: the node's NUMA policy, as the kubelet's Topology Manager states it. "
                   "single-numa-node binds every dedicated_cores pod to one NUMA node (refused if none holds it) "
                   "and lets the upstream NodeResourceTopologyMatch plugin filter on it; the others keep "
                   "Tidal's per-pod binding (annotations), which that plugin does not filter on.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--config", default=None, type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
              callback=lambda ctx, param, value: _config_file().load(ctx, param, value), metavar="FILE",
              help="Read the flags' values from this YAML file (e.g. /etc/tidal/agent.yaml; a key per flag, its "
                   "name without dashes); flags given here override it. See docs/configuration.md.")
@click.option("--print-config", default=None, is_flag=False, flag_value="yaml", type=click.Choice(["yaml", "json"]),
              help="Print the effective configuration and where each value came from (default, file, flag), "
                   "and exit.")
def agent(root: str, socket_path: str, state_dir: str, reserved_cpus, period: float, tcp_port, tcp_token_file,
          socket_group, max_workloads_per_user: int, plugin_uid, plugin_socket, cgroup_base: str,
          cgroup_parent: str, no_resize: bool, revert: bool, push_command, push_url, push_format: str,
          push_resend: float, yarn_rm, yarn_node_id, yarn_node_host, offline_cgroups, nm_cgroups,
          yarn_container_tier: str, eviction_grace: float,
          memory_evict_below, memory_pressure_threshold: float, cpu_pressure_threshold: float,
          io_pressure_threshold: float, reclaim_buffer: float, lending_notice: str, online_policy: str, hooks,
          guard_interval: float,
          no_confine_self: bool, record_cgroups: bool,
          dedicated_partition: str,
          online_nic, offline_nic, offline_gateway, net_netns, no_ingress_shaping: bool, kube_node, kubeconfig,
          kubelet_root_dir, kubelet_cgroup_driver, topology_policy: str, log_level: str, print_config) -> None:
    """Run the node agent in the foreground (what `make run` and the systemd unit start)."""
    import logging

    from agent.daemon import Agent, AgentConfig
    from agent.isolation.cgroups.desired import CgroupOptions

    logging.basicConfig(level=getattr(logging, log_level.upper()), format="tidal agent: %(levelname)s %(message)s")
    with _config_file().blamed(click.get_current_context()):  # a bad value from the file names the file
        config = AgentConfig(root=root, socket_path=socket_path, state_dir=state_dir,
                             reserved_cpus=parse_reserved(reserved_cpus), period=period, tcp_port=tcp_port,
                             cgroup_base=cgroup_base, cgroup_parent=cgroup_parent, resize=not no_resize,
                             revert_on_exit=revert, record_cgroups=record_cgroups, confine_self=not no_confine_self,
                             cgroup_options=CgroupOptions(dedicated_partition=dedicated_partition),
                             push_command=parse_argv("--push-command", push_command), push_url=push_url,
                             push_format=push_format, push_resend=push_resend,
                             yarn_rm=check_yarn_rm(yarn_rm, yarn_node_id, yarn_node_host), yarn_node_id=yarn_node_id,
                             yarn_node_host=yarn_node_host,
                             yarn_nodemanager_cgroups=parse_offline_cgroups(nm_cgroups, cgroup_base,
                                                                            "--yarn-nodemanager-cgroup"),
                             offline_cgroups=parse_offline_cgroups(dict.fromkeys(offline_cgroups + nm_cgroups), cgroup_base),
                             yarn_container_tier=yarn_container_tier,
                             eviction_grace=eviction_grace,
                             memory_evict_below=parse_size("--memory-evict-below", memory_evict_below),
                             memory_pressure_threshold=memory_pressure_threshold,
                             cpu_pressure_threshold=cpu_pressure_threshold,
                             io_pressure_threshold=io_pressure_threshold, online_policy=online_policy,
                             hooks=parse_hooks(hooks),
                             guard_interval=guard_interval, socket_group=group_id(socket_group),
                             max_workloads_per_user=max_workloads_per_user, plugin_uid=plugin_uid,
                             plugin_socket=plugin_socket_path(socket_path, plugin_socket),
                             tcp_token=tcp_token(tcp_port, tcp_token_file),
                             net=net_config(online_nic, offline_nic, offline_gateway, net_netns, not no_ingress_shaping),
                             reclaim_buffer=reclaim_buffer, lending_notice=parse_duration("--lending-notice", lending_notice),
                             local_settings=_config_file().local_keys(click.get_current_context()))
    if print_config:  # after every value was checked as the agent would take it
        click.echo(_config_file().render(click.get_current_context(), print_config))
        return
    if kube_node:
        from agent.k8s.cpumanager import kubelet_cpu_manager_policy, refusal

        try:
            policy = kubelet_cpu_manager_policy(kubelet_root_dir)
        except ValueError as exc:
            raise TidalError(f"the kubelet's CPU manager checkpoint: {exc}") from None
        why = refusal(policy, kubelet_root_dir)
        if why:
            raise TidalError(why)
        config = dataclasses.replace(config, kubelet_cpu_manager=policy or "unknown (no checkpoint)")
    agent = Agent(config, echo=click.echo)
    if kube_node:
        from agent.k8s.node import KubeNodeAgent

        api = kube_client(kubeconfig)
        holder = {}

        def on_start():  # once the agent has its state: pods, reports, lending
            holder["k8s"] = KubeNodeAgent(agent, api, kube_node, kubelet_driver=kubelet_cgroup_driver,
                                          topology_policy=topology_policy, kubelet_root=kubelet_root_dir)
            holder["k8s"].start()
            click.echo(f"tidal agent: Kubernetes node {kube_node}: watching its pods, publishing its topology")

        agent.on_started = on_start
    sys.exit(agent.run())


def _config_file():
    from agent import configfile

    return configfile


def check_yarn_rm(url: Optional[str], node_id: Optional[str], node_host: Optional[str]) -> Optional[str]:
    if url is None:
        if node_id or node_host:
            raise TidalError("--yarn-node-id and --yarn-node-host go with --yarn-rm")
        return None
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TidalError(f"--yarn-rm: expected the ResourceManager's web address (http://HOST:PORT), got {url!r}")
    if node_id is not None and not re.fullmatch(r"[A-Za-z0-9.\-_]+:[0-9]{1,5}", node_id):
        raise TidalError(f"--yarn-node-id: expected HOST:PORT as the RM lists nodes, got {node_id!r}")
    return url


def parse_size(option: str, value: Optional[str]) -> Optional[int]:
    """A memory size as Kubernetes writes it (``512Mi``, ``1Gi``, ``2G``, bytes), at least 1 MiB."""
    from agent.tunables import size

    if value is None:
        return None
    try:
        return size(value)
    except ValueError as exc:
        raise TidalError(f"{option}: {exc}") from None


def parse_duration(option: str, value: str) -> float:
    from agent.tunables import notice

    try:
        return notice(value)
    except ValueError as exc:
        raise TidalError(f"{option}: {exc}") from None


def parse_offline_cgroups(paths, base: str = "tidal", option: str = "--offline-cgroup") -> tuple:
    out = []
    for path in paths:
        parts = [p for p in path.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts) or any(c in path for c in "\0\n"):
            raise TidalError(f"{option}: expected a cgroup path from the hierarchy's root, got {path!r}")
        if parts[0] == base:
            raise TidalError(f"{option} {path}: inside Tidal's own tree, which is counted already "
                             f"(run offline work as reclaimed_cores workloads there)")
        out.append("/".join(parts))
    if len(set(out)) != len(out):
        raise TidalError(f"{option}: a path is given twice")
    return tuple(out)


def group_id(name: Optional[str]) -> Optional[int]:
    if name is None:
        return None
    import grp

    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise TidalError(f"--socket-group {name!r}: no such group") from None


def plugin_socket_path(socket_path: str, path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    if os.path.abspath(path) == os.path.abspath(socket_path):
        raise TidalError("--plugin-socket must differ from --socket")
    return path


def tcp_token(port: Optional[int], path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    if port is None:
        raise TidalError("--tcp-token-file goes with --tcp-port")
    from agent.authority import read_token

    return read_token(path)


def net_config(online_nic, offline_nic, gateway, netns, ingress: bool):
    """The --online-nic/--offline-nic options as a NetConfig (checked before anything is built)."""
    if online_nic is None:
        if offline_nic or gateway or netns:
            raise TidalError("--offline-nic, --offline-gateway and --net-netns need --online-nic")
        return None
    from agent.isolation.net.policy import NetConfig
    from agent.isolation.net.shaper import nic_roles

    online, offline = nic_roles(online_nic, offline_nic, gateway)
    if gateway and offline is None:
        raise TidalError("--offline-gateway needs --offline-nic")
    config = NetConfig(online, offline, netns=netns, ingress=ingress)
    config.check()
    return config


def parse_argv(option: str, value: Optional[str]):
    """An argument vector given as a JSON list of strings (never a shell string)."""
    if value is None:
        return None
    try:
        argv = json.loads(value)
    except (ValueError, RecursionError):
        raise TidalError(f'{option}: expected a JSON list of strings, e.g. \'["/usr/bin/cmd", "arg"]\'') from None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise TidalError(f"{option}: expected a non-empty JSON list of non-empty strings")
    return argv


def parse_hooks(values):
    from agent.lending import STATES

    hooks = {}
    for value in values:
        state, sep, argv = value.partition("=")
        if not sep or state not in STATES:
            raise TidalError(f"--hook: expected STATE=JSON-ARGV with STATE one of {', '.join(STATES)}, got {value!r}")
        hooks[state] = parse_argv(f"--hook {state}", argv)
    return hooks


def _client(socket_path: str):
    from agent.client import AgentClient

    return AgentClient(socket_path)


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@SOCKET_OPTION
@click.option("--qos", default="shared_cores", show_default=True,
              type=click.Choice(["dedicated_cores", "shared_cores", "reclaimed_cores", "system_cores"]))
@click.option("--cpus", type=FiniteRange(0, min_open=True), default=None,
              help="Whole cpus (dedicated_cores) or cpus (others).")
@click.option("--millicpu", type=int, default=None, help="Millicores (shared/reclaimed; default 1000).")
@click.option("--numa-binding", is_flag=True, help="dedicated_cores: cpus and memory of one NUMA node.")
@click.option("--numa-exclusive", is_flag=True, help="dedicated_cores: take the NUMA node alone.")
@click.option("--tier", type=click.Choice(["high", "min", "low"]), default=None, help="reclaimed_cores tier.")
@click.option("--name", default=None, help="Workload name (default run-<pid>).")
@click.option("--offline-cgroup", default=None, metavar="PATH",
              help="Run COMMAND in this offline system's own cgroup instead (one the agent declares with "
                   "--offline-cgroup or --yarn-nodemanager-cgroup: a NodeManager, a ResourceManager); root only.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(socket_path: str, qos: str, cpus, millicpu, numa_binding: bool, numa_exclusive: bool, tier, name,
        offline_cgroup, command) -> None:
    """Run COMMAND in a workload: ask the agent for an allocation, join its cgroup, exec.

    The exit status is COMMAND's own (this process becomes it, as with
    `systemd-run --scope`); the agent releases the allocation once its
    cgroup is empty.
    """
    if offline_cgroup is not None:
        ctx = click.get_current_context()
        given = [o for o in ("qos", "cpus", "millicpu", "numa_binding", "numa_exclusive", "tier", "name")
                 if ctx.get_parameter_source(o) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise TidalError(f"--offline-cgroup runs COMMAND outside Tidal's workloads: "
                             f"--{given[0].replace('_', '-')} does not go with it")
        _client(socket_path).request("POST", "/v1/offline/attach", {"cgroup": offline_cgroup, "pid": os.getpid()})
        _exec(command)
    if cpus is not None and millicpu is not None:
        raise TidalError("give --cpus or --millicpu, not both")
    doc = {"name": name or f"run-{os.getpid()}", "qos": qos}
    if cpus is not None:
        doc["cpus"] = int(cpus) if float(cpus).is_integer() else cpus
    elif millicpu is not None:
        doc["millicpu"] = millicpu
    elif qos in ("shared_cores", "reclaimed_cores"):
        doc["millicpu"] = 1000
    if numa_binding:
        doc["numa_binding"] = True
    if numa_exclusive:
        doc["numa_exclusive"] = True
    if tier:
        doc["tier"] = tier
    client = _client(socket_path)
    client.request("POST", "/v1/workloads", doc)
    try:
        client.request("POST", f"/v1/workloads/{quote(doc['name'], safe='')}/attach", {"pid": os.getpid()})
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(command[0], list(command))
    except OSError as exc:
        client.call("DELETE", f"/v1/workloads/{quote(doc['name'], safe='')}")
        click.echo(f"tidal: error: cannot run {command[0]!r}: {exc.strerror}", err=True)
        sys.exit(127)
    except TidalError:
        client.call("DELETE", f"/v1/workloads/{quote(doc['name'], safe='')}")
        raise


def _exec(command) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(command[0], list(command))
    except OSError as exc:
        click.echo(f"tidal: error: cannot run {command[0]!r}: {exc.strerror}", err=True)
        sys.exit(127)


@main.command()
@SOCKET_OPTION
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def ps(socket_path: str, as_json: bool) -> None:
    """List the workloads the agent manages."""
    data = _client(socket_path).request("GET", "/v1/workloads")["workloads"]
    if as_json:
        emit_json(data)
        return
    rows = [("NAME", "QOS", "CPUS", "MEMS", "MILLICPU", "TIER", "PIDS", "USAGE")]
    for w in data:
        usage = "-" if w.get("usage_millicpu") is None else f"{w['usage_millicpu']}m"
        rows.append((w["name"], w["qos"], w["cpus"] or "-", w["mems"] or "-", str(w["millicpu"]), w["tier"] or "-",
                     ",".join(map(str, w["pids"][:6])) + ("…" if len(w["pids"]) > 6 else "") or "-", usage))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


@main.command("release")
@SOCKET_OPTION
@click.argument("name")
def release_cmd(socket_path: str, name: str) -> None:
    """Release workload NAME (its processes return to the parent cgroup)."""
    _client(socket_path).request("DELETE", f"/v1/workloads/{quote(name, safe='')}")
    click.echo(f"released {name}")


@main.command()
@SOCKET_OPTION
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def status(socket_path: str, as_json: bool) -> None:
    """Per-core map: which pool and workload holds each cpu, and its usage."""
    data = _client(socket_path).request("GET", "/v1/status")
    if as_json:
        emit_json(data)
        return
    pools_ = data["pools"]
    click.echo(f"cgroup v{data['cgroup_version']}, tree {data['cgroup_base']}, {data['workloads']} workloads, "
               f"last reconcile {data['last_reconcile_ms']} ms, drift repairs {data['counters']['drift_repairs']}")
    isolation = data.get("dedicated_isolation") or {}
    if isolation:
        click.echo(f"dedicated cores: {isolation['mode']}" + (f" ({isolation['why']})" if isolation.get("why") else ""))
        for path, reason in sorted(isolation.get("refused", {}).items()):
            click.echo(f"  {path}: plain cpuset, partition refused: {reason}")
    for name in ("reserved", "shared", "reclaimed", "dedicated"):
        click.echo(f"  {name:<10} {pools_[name] or '-'}")
    runtime = data.get("runtime")
    if runtime and data.get("workloads_by_source", {}).get("kubernetes") or (runtime or {}).get("nri_last_heard_seconds"):
        road = ("the runtime, through Tidal's NRI plugin, at container creation; the agent's own cgroup writes too"
                if runtime["pods_confined_by"] != "kubelet-cgroups" else
                f"the agent's writes of the kubelet's cgroups (NRI plugin: {runtime['nri_plugin']})")
        click.echo(f"pods confined by {road}")
    if "online_millicpu" in data:
        declared = ", ".join(f"{c['path']} {'-' if c['millicpu'] is None else str(c['millicpu']) + 'm'}"
                             for c in data.get("offline_cgroups", []))
        click.echo(f"online use {data['online_millicpu']}m" + (f"; declared offline: {declared}" if declared else ""))
    memory = data.get("memory")
    if memory:
        gib = lambda n: "-" if n is None else f"{n / 2 ** 30:.1f} GiB"  # noqa: E731
        pressure = memory["online_pressure_percent"]
        click.echo(f"memory available {gib(memory['available_bytes'])} of {gib(memory['total_bytes'])} "
                   f"(reclaimed work evicted under {gib(memory['evict_below_bytes'])}); online "
                   f"{gib(memory['online_bytes'])}, reclaimed {gib(memory['reclaimed_bytes'])}; online memory "
                   f"pressure " + ("- (no PSI)" if pressure is None and memory["pressure_scope"] is None else
                                   f"{'-' if pressure is None else f'{pressure:.1f}%'} "
                                   f"({memory['pressure_scope']}; evicts at {memory['pressure_threshold_percent']:g}%)"))
        if memory.get("protected_bytes") is not None:
            click.echo(f"online memory protected (memory.low): {gib(memory['protected_bytes'])} in "
                       f"{len(memory['protection'])} cgroups")
        if memory.get("offline_throttled_to_bytes") is not None:
            click.echo(f"offline memory THROTTLED to {gib(memory['offline_throttled_to_bytes'])} (online stalled on "
                       f"memory; {memory['pressure_throttles']} cuts so far)")
    cpu = data.get("cpu_pressure")
    if cpu:
        pct = lambda v: "-" if v is None else f"{v:.1f}%"  # noqa: E731
        click.echo(("online cpu pressure - (no PSI)" if cpu["scope"] is None else
                    f"online cpu pressure {pct(cpu['online_cpu_percent'])} ({cpu['scope']}; takes lent cpus back at "
                    f"{cpu['threshold_percent']:g}%; {cpu['shrinks']} times so far"
                    + (f"; lending held {cpu['lending_held_periods']} more periods" if cpu["lending_held_periods"]
                       else "") + ")"))
    kernel = data.get("kernel_work")
    if kernel and kernel["confined"]:
        click.echo("reclaimed work kept off online's idle cpus (it runs in the kernel): " + ", ".join(
            f"{name} ({kernel['kernel_millicpu'].get(name, '-')} millicpu in the kernel)" for name in kernel["confined"]))
    io = data.get("io_pressure")
    if io:
        pct = lambda v: "-" if v is None else f"{v:.1f}%"  # noqa: E731
        acts = (f"limits offline io at {io['threshold_percent']:g}%; {io['throttles']} times so far"
                if io["supported"] and io["threshold_percent"] > 0 else
                "shown only: " + ("off" if io["supported"] else "no io controller"))
        click.echo("online io pressure - (no PSI)" if io["scope"] is None else
                   f"online io pressure {pct(io['online_io_percent'])} ({io['scope']}; {acts})")
        if io["limits"]:
            from agent.services.io_guard import describe

            click.echo("offline io LIMITED: " + describe({d: (v["read_bps"], v["write_bps"])
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
        click.echo(line)
    for kind, why in sorted((data.get("conflicts") or {}).items()):
        click.echo(f"CONFLICT ({kind}): {why}")
    causes = {k: v for k, v in (data.get("evictions_by_cause") or {}).items() if v}
    if causes:
        click.echo("evictions " + ", ".join(f"{cause} {count}" for cause, count in causes.items()))
    for target in data.get("push", []):
        sent = target.get("last_sent") or {}
        figures = f"{sent['vcores']} vcores, {sent['memory_mb']} MB" if "vcores" in sent else "-"
        line = (f"push {target['kind']} {target['name']}: sent {target['sent']}, failures {target['failures']}, "
                f"last sent {figures}")
        if target.get("node_id"):
            line += f" to node {target['node_id']}" + (" (floored at YARN's minimum)" if target.get("floored") else "")
        if target["consecutive_failures"]:
            line += f"; FAILING: {target['last_error']}"
        click.echo(line)
    click.echo("")
    rows = [("CPU", "NUMA", "CORE", "POOL", "WORKLOAD", "USAGE")]
    for c in data["cpus"]:
        usage = "-" if c["usage_millicpu"] is None else f"{c['usage_millicpu'] / 10:.0f}%"
        rows.append((str(c["id"]), str(c["numa"]), str(c["core"]), c["pool"], c["workload"] or "-", usage))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())


@main.command()
@SOCKET_OPTION
@click.option("--format", "fmt", default="tidal", show_default=True, type=click.Choice(["tidal", "yarn", "mesos", "mesos-array"]))
@click.option("--watch", is_flag=True, help="Print every change (long-poll) until interrupted.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def capacity(socket_path: str, fmt: str, watch: bool, as_json: bool) -> None:
    """The reclaimed capacity offline agents may use now."""
    from agent.client import AgentClient

    client = AgentClient(socket_path, timeout=LONG_POLL_S + 30)  # longer than the server holds a long-poll
    generation = None
    while True:
        path = "/v1/capacity?format=tidal"
        if generation is not None:
            path += f"&wait_generation={generation}&timeout={LONG_POLL_S}"
        doc = client.request("GET", path)
        if generation is None or doc["generation"] != generation:
            _print_capacity(doc, fmt, as_json)
        if not watch:
            return
        generation = doc["generation"]


LONG_POLL_S = 60


def _print_capacity(doc, fmt: str, as_json: bool) -> None:
    from contracts.capacity import render_capacity

    shaped = render_capacity(doc, fmt)
    if as_json or fmt != "tidal":
        click.echo(json.dumps(shaped))
        return
    r = doc["reclaimed"]
    line = (f"{doc['updated_at']}  gen {doc['generation']}  {doc['node_state']}  reclaimed {r['millicpu'] / 1000:g} cpus, "
            f"{r['memory_bytes'] / 2 ** 30:.1f} GiB on cpus {r['cpus'] or '-'}  ({doc['source']})")
    if doc.get("deadline"):
        line += f"  deadline {doc['deadline']}"
    click.echo(line)


@main.group(cls=_Group)
def node() -> None:
    """Whole-machine lending: Online -> OnlineToOffline -> Offline -> OfflineToOnline -> Online."""


def _show_node(data, as_json: bool) -> None:
    if as_json:
        emit_json(data)
    else:
        extra = f", deadline {data['deadline']}" if data.get("deadline") else ""
        click.echo(f"{data['state']} since {data['since'] or 'start'}{extra}")


@node.command("lend")
@SOCKET_OPTION
@click.option("--notice", default="60s", show_default=True, help="Time online workloads get to finish.")
@click.option("--json", "as_json", is_flag=True)
def node_lend(socket_path: str, notice: str, as_json: bool) -> None:
    """Lend the whole machine to offline work."""
    _show_node(_client(socket_path).request("POST", "/v1/node/lend", {"notice": notice}), as_json)


@node.command("reclaim")
@SOCKET_OPTION
@click.option("--notice", default="60s", show_default=True, help="Time offline work gets before it is killed.")
@click.option("--json", "as_json", is_flag=True)
def node_reclaim(socket_path: str, notice: str, as_json: bool) -> None:
    """Take the machine back for online work."""
    _show_node(_client(socket_path).request("POST", "/v1/node/reclaim", {"notice": notice}), as_json)


@node.command("status")
@SOCKET_OPTION
@click.option("--json", "as_json", is_flag=True)
def node_status(socket_path: str, as_json: bool) -> None:
    """The node's lending state."""
    _show_node(_client(socket_path).request("GET", "/v1/node"), as_json)


@main.group(cls=_Group)
def net() -> None:
    """Traffic shaping: online first, offline capped and routed through the offline NIC."""


@net.command("status")
@SOCKET_OPTION
@click.option("--json", "as_json", is_flag=True)
def net_status(socket_path: str, as_json: bool) -> None:
    """Per NIC: the classes, their rates, bytes and drops, and the classifier in use."""
    from agent.isolation.net.policy import format_rate

    data = _client(socket_path).request("GET", "/v1/net")
    if as_json:
        emit_json(data)
        return
    if not data.get("enabled"):
        click.echo("network shaping is off (start the agent with --online-nic NAME:RATE)")
        return
    click.echo(f"classifier: {data['classifier_detail']}")
    if data.get("offline_via"):
        click.echo(f"offline traffic: mark {data['mark']} -> table {data['table']} -> {data['offline_via']}"
                   f" (failovers {data['failovers']})")
    for nic in data["nics"]:
        click.echo(f"{nic['name']} ({nic['role']}, {format_rate(nic['link_bps'])}, "
                   f"{'up' if nic['running'] else 'DOWN'})")
        for direction in ("egress", "ingress"):
            if direction not in nic:
                continue
            side = nic[direction]
            click.echo(f"  {direction}{' via ' + side['device'] if 'device' in side else ''}: "
                       f"online peak {format_rate(side['online_peak_bps'])}, offline ceiling "
                       f"{format_rate(side['offline_ceil_bps'] or 0)}")
            click.echo(f"    {'class':<8} {'rate':>10} {'ceil':>10} {'bytes':>14} {'packets':>10} {'drops':>7}")
            for name in ("online", "system", "offline"):
                c = side["classes"].get(name)
                if c:
                    click.echo(f"    {name:<8} {format_rate(c['rate_bps']):>10} {format_rate(c['ceil_bps']):>10} "
                               f"{c['bytes']:>14} {c['packets']:>10} {c['drops']:>7}")


@main.group(cls=_Group)
def yarn() -> None:
    """YARN beside Tidal: the NodeManager's configuration and how to start it."""


@yarn.command("config")
@click.option("--rm", "rm_url", default=None, metavar="URL",
              help="Read the minimum allocation from this ResourceManager (its web address) instead of YARN's "
                   "defaults (1 vcore, 1024 MB).")
@click.option("--nodemanager-cgroup", default="/hadoop-yarn", show_default=True, metavar="PATH",
              help="The NodeManager's own cgroup, as given to the agent's --yarn-nodemanager-cgroup.")
def yarn_config(rm_url, nodemanager_cgroup: str) -> None:
    """Print the yarn-site.xml properties a NodeManager next to Tidal needs, and the commands that start
    the agent and the NodeManager."""
    from agent.reporter.yarn import YarnTarget, site_fragment
    from contracts.capacity import YARN_DEFAULT_MINIMUM

    (path,) = parse_offline_cgroups([nodemanager_cgroup], option="--nodemanager-cgroup")
    minimum = YARN_DEFAULT_MINIMUM
    if rm_url is not None:
        try:
            target = YarnTarget(rm_url)
        except ValueError:
            raise TidalError(f"--rm: expected the ResourceManager's web address (http://HOST:PORT), "
                             f"got {rm_url!r}") from None
        minimum = target.read_minimum()
        if target.minimum_source != "rm":
            raise TidalError(f"--rm {rm_url}: the ResourceManager did not say its minimum allocation (is it "
                             f"running? GET {rm_url}/conf)")
    rm = rm_url or "http://RM-HOST:8088"
    click.echo(f"<!-- yarn-site.xml of the NodeManager, inside <configuration>; for the RM at {rm} -->")
    click.echo(site_fragment(*minimum), nl=False)
    click.echo(f"<!-- then, as root:\n"
               f"  tidal agent --yarn-rm {rm} --yarn-nodemanager-cgroup /{path}\n"
               f"  tidal run --offline-cgroup /{path} -- \"$HADOOP_HOME/bin/yarn\" nodemanager\n"
               f"-->")


@main.group(cls=_Group)
def cluster() -> None:
    """The cluster side: simulation (and, with Kubernetes, the extender and the lending controller)."""


KUBECONFIG_OPTION = click.option(
    "--kubeconfig", default=None, type=click.Path(dir_okay=False),
    help="Kubeconfig to use (default: in-cluster service account, then ~/.kube/config).")


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
    import signal
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
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
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
                      fair: bool, no_preemption: bool, stale_after: float, leader_elect: bool, lease_namespace: str,
                      lease_name: str, metrics_port: int, metrics_address: str) -> None:
    """Schedule pods (alone or in gangs) on the nodes' reports: NUMA-true, preempting reclaimed work."""
    import logging
    import signal
    import threading

    from kube.rest import Rest
    from cluster.scheduler.service import Scheduler

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rest = Rest.from_config(kube_client(kubeconfig).configuration)
    if bind_processes is None:
        bind_processes = min(8, (os.cpu_count() or 1) // 4)
    scheduler = Scheduler(rest, scheduler_name, policy, shards, bind_workers, stale_after, batch, fair,
                          not no_preemption, bind_processes)
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, metrics_address, registry=scheduler.metrics.registry)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
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
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    scheduler.close()
    if lost.is_set():
        raise TidalError("leader election lost: another replica may be scheduling; exiting")


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


@main.group(cls=_Group)
def bench() -> None:
    """Benchmarks (JSON out; comparisons side by side in one run)."""


@bench.command("topology")
@ROOT_OPTION
@click.option("--repeat", default=20, show_default=True, type=click.IntRange(1, 10000))
@click.option("--json", "as_json", is_flag=True, help="JSON output (the default is JSON too; kept for symmetry).")
def bench_topology(root: str, repeat: int, as_json: bool) -> None:
    """Discovery time of ROOT in-process, beside lstopo as a whole process."""
    from agent.bench.topology import run

    emit_json(run(root, repeat))


@bench.command("net-isolation")
@click.option("--link-mbps", default=200, show_default=True, type=click.IntRange(1, 10000),
              help="Rate the emulated link is held to.")
@click.option("--seconds", default=4.0, show_default=True, type=FiniteRange(1, 600), help="Length of each run.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Rounds of (unloaded, none, tidal, tidal_shaper_only), interleaved; p99 is over all rounds' "
                   "samples (5 rounds of 4 s: 10,000 per scenario).")
@click.option("--rr-rate", default=500.0, show_default=True, type=FiniteRange(1, 20000),
              help="Online requests per second.")
@click.option("--pm-qos/--no-pm-qos", default=True, show_default=True,
              help="Hold idle cpus awake (PM QoS, /dev/cpu_dma_latency = 0) for the whole run, every scenario alike: "
                   "on a VM, waking a halted vCPU goes through the hypervisor.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_net_isolation(link_mbps: int, seconds: float, repeats: int, rr_rate: float, pm_qos: bool,
                        as_json: bool) -> None:
    """Online latency under an offline flood: no shaping vs Tidal, in namespaces it makes (root)."""
    from agent.bench.net_isolation import run

    emit_json(run(link_mbps, seconds, repeats, rr_rate, pm_qos=pm_qos,
                  progress=lambda line: click.echo(line, err=True)))


@bench.command("placement")
@click.option("--nodes", default=10000, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--pods", default=100000, show_default=True, type=click.IntRange(1, 10_000_000))
@click.option("--baseline-pods", default=2000, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Pods the per-node loop places (its rate per pod does not depend on the count).")
@click.option("--policy", default="pack", show_default=True, type=click.Choice(["pack", "spread"]))
@click.option("--seed", default=1, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_placement(nodes: int, pods: int, baseline_pods: int, policy: str, seed: int, as_json: bool) -> None:
    """Cluster placement pods/s (NUMA-aware, vectorised) beside a per-node loop doing the same checks."""
    from cluster.placement.bench import run

    emit_json(run(nodes, pods, baseline_pods, policy, seed))


@bench.command("extender")
@click.option("--nodes", default=5000, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--calls", default=300, show_default=True, type=click.IntRange(10, 100_000))
@click.option("--client", default="auto", show_default=True, type=click.Choice(["auto", "go", "python"]),
              help="Who calls the extender: a Go client (as kube-scheduler does; needs go) or Python.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_extender(nodes: int, calls: int, client: str, as_json: bool) -> None:
    """Scheduler-extender filter+prioritize latency per call with N candidate nodes (HTTP, loopback)."""
    from cluster.extender_bench import run

    emit_json(run(nodes, calls, client=client))


@bench.command("scheduler")
@click.option("--nodes", default=1000, show_default=True, type=click.IntRange(1, 100_000),
              help="KWOK nodes, made from the shapes of real machines.")
@click.option("--pods", default=5000, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--mode", default="backlog", show_default=True, type=click.Choice(["backlog", "stream"]),
              help="backlog: pods created first, then each scheduler runs (its own throughput); stream: pods "
                   "created at --rate while it runs (creation-to-binding latency).")
@click.option("--rate", default=None, type=FiniteRange(1, 1_000_000),
              help="Pods created a second in stream mode (default: as fast as the API server takes them).")
@click.option("--numa-share", default=0.1, show_default=True, type=FiniteRange(0, 1),
              help="Share of the pods that are dedicated and NUMA-bound (2 cpus, 2 GiB in one zone).")
@click.option("--shards", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Tidal scheduler instances (--shards of tidal cluster scheduler).")
@click.option("--only", "only", default=None, type=click.Choice(["kube-scheduler", "tidal"]),
              help="Run one scheduler only.")
@ROOT_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON; progress on stderr).")
def bench_scheduler(nodes: int, pods: int, mode: str, rate, numa_share: float, shards: int, only, shapes_dir,
                    as_json: bool) -> None:
    """kube-scheduler and Tidal's scheduler on one API server with N KWOK nodes: pods/s, latency, cpu."""
    from agent.bench.fleet import shapes as fleet_shapes
    from cluster.scheduler import bench
    from kube.rest import ApiError

    roots = _captured_trees(shapes_dir)
    try:
        result = bench.run(fleet_shapes(roots), nodes, pods, mode, rate, numa_share, shards,
                           (only,) if only else ("kube-scheduler", "tidal"),
                           progress=lambda line: click.echo(f"tidal bench scheduler: {line}", err=True))
    except (RuntimeError, TimeoutError, ApiError) as exc:
        raise TidalError(str(exc)) from None
    emit_json(result)


@bench.command("qrm")
@click.option("--root", default=None, type=click.Path(file_okay=False),
              help="Tree to allocate on (default: a synthetic 2x4x8x4 = 256-cpu node).")
@click.option("--workloads", default=500, show_default=True, type=click.IntRange(1, 100000))
@click.option("--repeat", default=20, show_default=True, type=click.IntRange(1, 10000))
@click.option("--churn-steps", default=3000, show_default=True, type=click.IntRange(0, 10 ** 7))
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_qrm(root, workloads: int, repeat: int, churn_steps: int, as_json: bool) -> None:
    """Allocation latency, checkpoint reload and fragmentation against first fit."""
    from agent.bench.qrm import run

    emit_json(run(root, workloads, repeat, churn_steps))


@bench.command("cpu-isolation")
@click.option("--duration", default=2.0, show_default=True, type=FiniteRange(0.5, 600),
              help="Seconds each scenario runs per round.")
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(1, 100),
              help="Rounds; in each the scenarios take turns.")
@click.option("--period-ms", default=5.0, show_default=True, type=FiniteRange(0.5, 1000),
              help="The probe's request period.")
@click.option("--work-us", default=300, show_default=True, type=click.IntRange(10, 100000),
              help="Fixed work per probe request.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_cpu_isolation(duration: float, repeats: int, period_ms: float, work_us: int, as_json: bool) -> None:
    """Online latency vs offline harvest: none, BestEffort, static split, Tidal (needs root)."""
    from agent.bench.cpu_isolation import run

    emit_json(run(duration, repeats, period_ms, work_us))


@bench.command("memory-isolation")
@click.option("--box", "box_mib", default=512, show_default=True, type=click.IntRange(256, 1 << 20),
              help="MiB of the node: a memory-limited cgroup the whole run lives in.")
@click.option("--online-anon", "online_anon_mib", default=64, show_default=True, type=click.IntRange(1, 1 << 20),
              help="MiB of anonymous memory in the online service's working set.")
@click.option("--online-file", "online_file_mib", default=64, show_default=True, type=click.IntRange(1, 1 << 20),
              help="MiB of page cache (a file it reads) in its working set.")
@click.option("--offline-share", default=0.8, show_default=True, type=FiniteRange(0.05, 2.0),
              help="The offline job's anonymous memory as a share of what online leaves.")
@click.option("--duration", default=10.0, show_default=True, type=FiniteRange(1, 600),
              help="Seconds each scenario runs per round.")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1, 50),
              help="Rounds; in each the scenarios take turns.")
@click.option("--dir", "directory", default="/var/tmp", show_default=True,
              type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the files go: a disk-backed filesystem (not tmpfs).")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_memory_isolation(box_mib: int, online_anon_mib: int, online_file_mib: int, offline_share: float,
                           duration: float, repeats: int, directory: str, as_json: bool) -> None:
    """Online latency, faults and OOM kills vs offline memory harvest: none, a plain limit, Tidal (needs root)."""
    from agent.bench.memory_isolation import run

    emit_json(run(box_mib=box_mib, online_anon_mib=online_anon_mib, online_file_mib=online_file_mib,
                  offline_share=offline_share, duration=duration, repeats=repeats, directory=directory,
                  progress=lambda line: click.echo(f"memory-isolation: {line}", err=True)))


@bench.command("reaction")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1, 1000))
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_reaction(steps: int, as_json: bool) -> None:
    """Online load step -> the reclaim pool shrunk in the kernel (needs root)."""
    from agent.bench.reaction import run

    emit_json(run(steps))


@bench.command("reserved")
@click.option("--seconds", default=3.0, show_default=True, type=FiniteRange(0.5, 600), help="Length of a round.")
@click.option("--repeats", default=4, show_default=True, type=click.IntRange(1, 100))
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_reserved(seconds: float, repeats: int, as_json: bool) -> None:
    """A system daemon's and the agent's latency with kernel-heavy reclaimed work kept off the reserved
    cpus, and on them (needs root)."""
    from agent.bench.reserved import run

    emit_json(run(seconds, repeats))


@bench.command("overhead")
@click.option("--workloads", default=200, show_default=True, type=click.IntRange(1, 5000))
@click.option("--seconds", default=30.0, show_default=True, type=FiniteRange(5, 3600))
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_overhead(workloads: int, seconds: float, as_json: bool) -> None:
    """The agent's own cpu and memory at steady state with N workloads (needs root)."""
    from agent.bench.overhead import run

    emit_json(run(workloads, seconds))


@bench.command("numa-usage")
@click.option("--seconds", default=20.0, show_default=True, type=FiniteRange(2, 3600))
@click.option("--period", default=1.0, show_default=True, type=FiniteRange(0.2, 60),
              help="Seconds between samples (the agent's period).")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_numa_usage(seconds: float, period: float, as_json: bool) -> None:
    """The v2 per-cpu offline estimate against v1's per-cpu counters on one load (needs root, v1)."""
    from agent.bench.numa_usage import run

    emit_json(run(seconds, period))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

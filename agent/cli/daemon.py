"""``tidal agent``: the daemon command, and the parsers of its options."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Optional

import click

from agent.errors import TidalError
from contracts.eviction import TIERS
from agent.cli import FiniteRange, ROOT_OPTION, SOCKET_OPTION, main
from agent.cli.cluster import kube_rest


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
@click.option("--online-cpu-burst", default=100, show_default=True, type=click.IntRange(0, 100), metavar="PERCENT",
              help="A shared_cores workload with a cpu limit (limit_millicpu) may burst above it by this share of "
                   "its quota, from quota it left unused (cpu.max.burst / cpu.cfs_burst_us; Linux >= 5.14); 0: "
                   "off. Never for reclaimed work.")
@click.option("--reclaimed-on-smt-siblings", is_flag=True,
              help="Let reclaimed work run on the SMT sibling threads of dedicated cpus (by default they are held "
                   "back: a sibling shares the core's pipeline and caches with the dedicated thread).")
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
@click.option("--yarn-container-tier", default="low", show_default=True, type=click.Choice(TIERS),
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
@click.option("--confine-host-units", "host_units", multiple=True, metavar="UNIT",
              help="A systemd slice, scope or service that is not Tidal's or the kubelet's (system.slice, "
                   "user.slice, init.scope) to hold on the reserved cpus through systemd (AllowedCPUs=, runtime); "
                   "its own value is saved and given back by --revert. Repeatable; needs systemd as PID 1.")
@click.option("--confine-host-cgroups", "host_cgroups", multiple=True, metavar="PATH",
              help="On a host without systemd: a cgroup from the hierarchy's root that is not Tidal's or the "
                   "kubelet's (the host's daemons, e.g. /system, /docker) to hold on the reserved cpus, with its "
                   "children on cgroup v1; its cpuset is saved and given back by --revert. Repeatable "
                   "(systemd hosts: --confine-host-units).")
@click.option("--cgroups-in-memory", "--record-cgroups", "cgroups_in_memory", is_flag=True,
              help="Keep the cgroups in memory, written nowhere (a dry run; tests off the host). With the kernel "
                   "left alone, so are the fast guard, self-confinement, the helpers' cgroup and the lifting of "
                   "io limits; the agent says so when it starts. (--record-cgroups: its former name.)")
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
@click.option("--pod-usage-period", default=15.0, show_default=True, type=click.FloatRange(0, 3600),
              help="With --kube-node: seconds between NodeUsage reports (each pod's cpu and memory, which "
                   "`tidal cluster metrics` serves to the HorizontalPodAutoscaler and kubectl top); 0: none.")
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
          cgroup_parent: str, no_resize: bool, online_cpu_burst: int, reclaimed_on_smt_siblings: bool, revert: bool, push_command, push_url, push_format: str,
          push_resend: float, yarn_rm, yarn_node_id, yarn_node_host, offline_cgroups, nm_cgroups,
          yarn_container_tier: str, eviction_grace: float,
          memory_evict_below, memory_pressure_threshold: float, cpu_pressure_threshold: float,
          io_pressure_threshold: float, reclaim_buffer: float, lending_notice: str, online_policy: str, hooks,
          guard_interval: float,
          no_confine_self: bool, host_units, host_cgroups, cgroups_in_memory: bool,
          dedicated_partition: str,
          online_nic, offline_nic, offline_gateway, net_netns, no_ingress_shaping: bool, kube_node, kubeconfig,
          kubelet_root_dir, kubelet_cgroup_driver, topology_policy: str, pod_usage_period: float, log_level: str,
          print_config) -> None:
    """Run the node agent in the foreground (what `make run` and the systemd unit start)."""
    import logging

    from agent.daemon import Agent, AgentConfig
    from agent.isolation.cgroups.desired import CgroupOptions

    logging.basicConfig(level=getattr(logging, log_level.upper()), format="tidal agent: %(levelname)s %(message)s")
    with _config_file().blamed(click.get_current_context()):  # a bad value from the file names the file
        config = AgentConfig(root=root, socket_path=socket_path, state_dir=state_dir,
                             reserved_cpus=parse_reserved(reserved_cpus), period=period, tcp_port=tcp_port,
                             cgroup_base=cgroup_base, cgroup_parent=cgroup_parent, resize=not no_resize,
                             reclaimed_on_smt_siblings=reclaimed_on_smt_siblings,
                             revert_on_exit=revert, cgroups_in_memory=cgroups_in_memory, confine_self=not no_confine_self,
                             host_units=parse_host_units(host_units),
                             cgroup_options=CgroupOptions(dedicated_partition=dedicated_partition,
                                                          online_cpu_burst_percent=online_cpu_burst,
                                                          host_cgroups=parse_host_cgroups(
                                                              host_cgroups, cgroup_base, offline_cgroups + nm_cgroups,
                                                              cgroup_parent)),
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

        rest = kube_rest(kubeconfig, "tidal-agent")
        holder = {}

        def on_start():  # once the agent has its state: pods, reports, lending
            holder["k8s"] = KubeNodeAgent(agent, rest, kube_node, kubelet_driver=kubelet_cgroup_driver,
                                          topology_policy=topology_policy, kubelet_root=kubelet_root_dir,
                                          pod_usage_period=pod_usage_period)
            holder["k8s"].start()
            click.echo(f"tidal agent: Kubernetes node {kube_node}: watching its pods, publishing its topology")

        agent.on_started = on_start
    end_process(agent.run())


def end_process(code: int) -> None:
    """The agent has stopped and said so: the process ends here, its output flushed, without the
    interpreter's finalization. Daemon threads (the Kubernetes watches and their TLS reads, the pusher)
    may still be inside a read, and finalizing around them once aborted the DaemonSet agent (SIGABRT
    after "tidal agent: stopped") where it should have exited 0."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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


def parse_host_units(units) -> tuple:
    from agent.isolation.systemd import unit_type

    for unit in units:
        try:
            unit_type(unit)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--confine-host-units") from None
        if unit in ("-.slice", "kubepods.slice", "tidal.slice") or unit.startswith("kubepods"):
            raise click.BadParameter(f"{unit!r} holds Tidal's or the kubelet's work, which Tidal places itself",
                                     param_hint="--confine-host-units")
    return tuple(dict.fromkeys(units))


def parse_host_cgroups(paths, base: str, offline, parent: str) -> tuple:
    """--confine-host-cgroups: paths from the hierarchy's root, none of them Tidal's, the kubelet's, an
    offline system's, or above one another (a child is held with its parent)."""
    option = "--confine-host-cgroups"
    held = parse_offline_cgroups(paths, base, option)
    if held and parent != "/":
        raise TidalError(f"{option}: its paths are from the hierarchy's root; with --cgroup-parent {parent} "
                         f"Tidal's tree is not there (use --cgroup-parent /, or --confine-host-units under systemd)")
    declared = {"/".join(part for part in path.split("/") if part) for path in offline}  # checked by their own option
    for path in held:
        if path.split("/")[0].startswith("kubepods"):
            raise TidalError(f"{option} {path}: the kubelet's pods, which Tidal places itself")
        if path in declared:
            raise TidalError(f"{option} {path}: declared offline (--offline-cgroup), whose work runs on "
                             f"reclaimed capacity, not the reserved cpus")
        above = [other for other in held if path.startswith(other + "/")]
        if above:
            raise TidalError(f"{option} {path}: below {above[0]}, which is held with everything under it")
    return held


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

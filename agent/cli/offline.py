"""Commands that read a captured tree or print a configuration: topology, plan, yarn config."""

from __future__ import annotations

import dataclasses
from typing import Optional

import click

from agent.errors import TidalError
from agent.cli import ROOT_OPTION, _Group, emit_json, main
from agent.cli.daemon import parse_cpulist_option, parse_offline_cgroups


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
@click.option("--reclaimed-on-smt-siblings", "siblings", is_flag=True,
              help="Let reclaimed work use the SMT siblings of dedicated cpus, as the agent's flag of that name.")
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def plan(root: str, reserved_cpus, reclaim_cpus, requests_file, siblings: bool, as_json: bool) -> None:
    """Dry run: how the QoS manager would place REQUESTS on the node at ROOT."""
    from agent.qrm.plan import plan_report, render_plan, run_plan
    from agent.qrm.policy import initial_state
    from agent.qrm.requests import parse_requests
    from agent.topology import HostFS, discover

    topo = discover(HostFS(root))
    reserved = parse_cpulist_option("--reserved-cpus", reserved_cpus)
    requests = parse_requests(requests_file.read(), requests_file.name)
    state = dataclasses.replace(initial_state(topo, reserved, reclaim_cpus), reclaim_siblings=siblings)
    state, rejected = run_plan(topo, state, requests)
    if as_json:
        emit_json(plan_report(topo, state, rejected))
    else:
        click.echo(render_plan(topo, state, rejected))


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

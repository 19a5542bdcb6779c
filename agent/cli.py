"""``tidal``: the operators' command line.

Every expected failure (``TidalError``) becomes one line on stderr,
``tidal: error: <what, naming the file or field>``, and exit code 2; usage
errors are click's (also exit 2). Commands import their layers lazily so
``tidal --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from agent.errors import TidalError


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TidalError as exc:
            click.echo(f"tidal: error: {exc}", err=True)
            ctx.exit(exc.exit_code)


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
def topology(root: str, as_json: bool) -> None:
    """Show the node's sockets, NUMA nodes, L3 groups, cores, threads, GPUs and NICs."""
    from agent.topology import HostFS, discover
    from agent.topology.render import render_topology

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


@main.command()
@ROOT_OPTION
@click.option("--socket", "socket_path", default="/run/tidal/tidal.sock", show_default=True,
              help="Unix socket of the local API.")
@click.option("--state-dir", default="/var/lib/tidal", show_default=True, type=click.Path(file_okay=False),
              help="Where the checkpoint and history are kept.")
def agent(root: str, socket_path: str, state_dir: str) -> None:
    """Run the node agent in the foreground (what `make run` and the systemd unit start)."""
    from agent.daemon import Agent, AgentConfig

    sys.exit(Agent(AgentConfig(root=root, socket_path=socket_path, state_dir=state_dir), echo=click.echo).run())


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

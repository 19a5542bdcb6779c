"""Commands that drive a running agent through its local API: run, ps, release, status, capacity, node, net."""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import quote

import click

from agent.errors import TidalError
from contracts.eviction import TIERS
from agent.cli import FiniteRange, SOCKET_OPTION, _Group, emit_json, main
from agent.cli.render import status_lines


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
@click.option("--limit-millicpu", type=int, default=None,
              help="shared_cores: a cpu limit (a quota), with the agent's burst above it (--online-cpu-burst).")
@click.option("--numa-binding", is_flag=True, help="dedicated_cores: cpus and memory of one NUMA node.")
@click.option("--numa-exclusive", is_flag=True, help="dedicated_cores: take the NUMA node alone.")
@click.option("--tier", type=click.Choice(TIERS), default=None, help="reclaimed_cores tier.")
@click.option("--name", default=None, help="Workload name (default run-<pid>).")
@click.option("--offline-cgroup", default=None, metavar="PATH",
              help="Run COMMAND in this offline system's own cgroup instead (one the agent declares with "
                   "--offline-cgroup or --yarn-nodemanager-cgroup: a NodeManager, a ResourceManager); root only.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(socket_path: str, qos: str, cpus, millicpu, limit_millicpu, numa_binding: bool, numa_exclusive: bool, tier, name,
        offline_cgroup, command) -> None:
    """Run COMMAND in a workload: ask the agent for an allocation, join its cgroup, exec.

    The exit status is COMMAND's own (this process becomes it, as with
    `systemd-run --scope`); the agent releases the allocation once its
    cgroup is empty.
    """
    if offline_cgroup is not None:
        ctx = click.get_current_context()
        given = [o for o in ("qos", "cpus", "millicpu", "limit_millicpu", "numa_binding", "numa_exclusive", "tier", "name")
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
    if limit_millicpu is not None:
        doc["limit_millicpu"] = limit_millicpu
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
    for line in status_lines(data):
        click.echo(line)


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

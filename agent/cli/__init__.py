"""``tidal``: the operators' command line (a package: one module per kind of command).

``offline`` reads captured trees and prints configurations (topology, plan, yarn config); ``daemon`` is
``tidal agent`` and the parsers of its options; ``client`` drives a running agent (run, ps, status,
capacity, node, net) with ``render`` for what it prints; ``cluster`` the cluster side (extender,
scheduler, lending controller, simulator); ``bench`` the benchmarks. This module holds what they share:
the group, option types, ``emit_json``.

Every expected failure (``TidalError``) becomes one line on stderr,
``tidal: error: <what, naming the file or field>``, and exit code 2; usage
errors are click's (also exit 2). Commands import their layers lazily so
``tidal --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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
        except click.exceptions.NoArgsIsHelpError as exc:  # `tidal`, `tidal node`: the help, not an error line
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message(), err=True)
            sys.exit(exc.exit_code)
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


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tidal", prog_name="tidal")
def main() -> None:
    """Tidal: colocate online services and offline batch work on one node."""


ROOT_OPTION = click.option(
    "--root", default="/", show_default=True, type=click.Path(file_okay=False),
    help="Root of the sysfs/procfs tree to read (a captured tree for tests).")



SOCKET_OPTION = click.option(
    "--socket", "socket_path", default=lambda: os.environ.get("TIDAL_SOCKET", "/run/tidal/tidal.sock"),
    show_default="$TIDAL_SOCKET or /run/tidal/tidal.sock", help="Unix socket of the agent's local API.")


# the commands register themselves on ``main`` (imported last: they import it from here)
from agent.cli import offline, daemon, client, cluster, bench  # noqa: E402,F401
from agent.cli.bench import _captured_trees  # noqa: E402,F401 - re-exported
from agent.cli.cluster import cluster_lending, cluster_scheduler, kube_client  # noqa: E402,F401
from agent.cli.daemon import agent, net_config, parse_duration, parse_offline_cgroups  # noqa: E402,F401

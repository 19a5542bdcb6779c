"""The agent's configuration file (``tidal agent --config /etc/tidal/agent.yaml``).

Every flag of ``tidal agent`` has a key: its long name without the dashes
(``--reserved-cpus 0`` is ``reserved-cpus: "0"``, ``--no-resize`` is
``no-resize: true``); a repeatable flag takes a list. Flags given on the
command line override the file, and the file overrides the defaults. A key
that is no flag, a value of the wrong shape or out of range, a file that is
not a YAML mapping: one line naming the file and the key, and the agent does
not start.

Two keys take YAML's own shapes besides the flag's text: ``push-command`` an
argument vector as a list, and ``hook`` a mapping of node state to argument
vector (each is turned into the flag's JSON text).

``--print-config`` shows the effective configuration with where each value
came from (``default``, ``file`` or ``flag``), as YAML that can be saved as a
config file, or as JSON.

The file is read through click's default map, so a value from the file goes
through the very conversion and checks its flag does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Dict, Iterator, List, Tuple

import click
import yaml

from agent.errors import TidalError

MAX_BYTES = 1 << 20  # a configuration file is a few kilobytes; anything this large is a mistake
SKIP = ("config", "print_config", "help")  # parameters that configure the configuration, not the agent
SOURCES = {"DEFAULT": "default", "DEFAULT_MAP": "file", "COMMANDLINE": "flag", "ENVIRONMENT": "environment",
           "PROMPT": "prompt"}


class ConfigError(click.ClickException):
    exit_code = 2


def key_of(param: click.Parameter) -> str:
    """A parameter's key in the file: its long flag name without the dashes."""
    longs = [o for o in param.opts if o.startswith("--")]
    return (longs[0] if longs else param.opts[0]).lstrip("-")


def options(command: click.Command) -> Dict[str, click.Option]:
    """The command's options that have a key, by key."""
    return {key_of(p): p for p in command.params if isinstance(p, click.Option) and p.name not in SKIP}


def read(path: str) -> Dict[str, Any]:
    """The file as a mapping; ``ConfigError`` (one line naming the file) when it cannot be."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"config file {path}: larger than {MAX_BYTES // 1024} KiB")
    try:
        doc = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path}: not YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"config file {path}: nested too deeply") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path}: a mapping of flag names to values, not a {type(doc).__name__}")
    return doc


def _argv(path: str, key: str, value: Any) -> Any:
    """An argument vector given as a YAML list: the flag's JSON text."""
    if isinstance(value, list):
        if not value or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"config file {path}: {key}: an argument vector is a non-empty list of strings")
        return json.dumps(value)
    return value


def _hooks(path: str, value: Any) -> Any:
    """``hook`` as a mapping of node state to argument vector: the flag's ``STATE=JSON`` texts."""
    if isinstance(value, dict):
        return [f"{state}={_argv(path, f'hook: {state}', argv)}" for state, argv in value.items()]
    return value


def defaults(command: click.Command, ctx: click.Context, path: str) -> Dict[str, Any]:
    """The file's values as click's default map (by parameter name), each checked as its flag is."""
    doc = read(path)
    known = options(command)
    out: Dict[str, Any] = {}
    for key, value in doc.items():
        param = known.get(key) if isinstance(key, str) else None
        if param is None:
            near = [k for k in known if isinstance(key, str) and (key.replace("_", "-") == k or k.startswith(key))]
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"config file {path}: unknown key {key!r}{hint}")
        if key == "hook":
            value = _hooks(path, value)
        elif "JSON-ARGV" in (param.metavar or ""):
            value = _argv(path, key, value)
        if param.multiple:
            value = value if isinstance(value, list) else [value]
            if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"config file {path}: {key}: a list of values")
        elif isinstance(value, (dict, list)):
            raise ConfigError(f"config file {path}: {key}: one value, not a {type(value).__name__}")
        elif value is None:
            raise ConfigError(f"config file {path}: {key}: no value (leave the key out for the default)")
        elif param.is_flag and not isinstance(value, bool):
            raise ConfigError(f"config file {path}: {key}: true or false")
        elif isinstance(value, bool) and not param.is_flag:
            raise ConfigError(f"config file {path}: {key}: {value!r} is not a value of this flag")
        try:
            param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise ConfigError(f"config file {path}: {key}: {exc.message}") from None
        out[param.name] = value
    return out


def load(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """The ``--config`` callback (eager: before every other option takes its default)."""
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **defaults(ctx.command, ctx, value)}
        ctx.meta["tidal.config_file"] = os.path.abspath(value)
    return value


def effective(ctx: click.Context) -> List[Tuple[str, Any, str]]:
    """(key, value, source) of every option, in the command's order."""
    rows = []
    for key, param in options(ctx.command).items():
        value = ctx.params.get(param.name)
        source = ctx.get_parameter_source(param.name)
        rows.append((key, list(value) if isinstance(value, tuple) else value,
                     SOURCES.get(source.name, source.name.lower()) if source is not None else "default"))
    return rows


def render(ctx: click.Context, fmt: str) -> str:
    rows = effective(ctx)
    path = ctx.meta.get("tidal.config_file")
    if fmt == "json":
        return json.dumps({"config_file": path, "values": {k: {"value": v, "source": s} for k, v, s in rows}},
                          indent=2, sort_keys=False)
    lines = ["# tidal agent: the effective configuration; after each value, where it came from",
             f"# (file: {path})" if path else "# (no --config file)"]
    for key, value, source in rows:
        if value is None:  # unset: a key with no value is refused, so it is shown commented out
            lines.append(f"# {key}:  # {source} (unset)")
            continue
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=1 << 16).strip()[1:-1]
        lines.append(f"{text}  # {source}")
    return "\n".join(lines)


@contextlib.contextmanager
def blamed(ctx: click.Context) -> Iterator[None]:
    """A value refused after conversion (``TidalError`` naming its ``--flag``) that came from the file is
    told as the file's key, so the operator edits the right place."""
    try:
        yield
    except TidalError as exc:
        match = re.match(r"--([a-z0-9-]+)(:?\s*)(.*)", str(exc), re.S)
        param = options(ctx.command).get(match.group(1)) if match else None
        path = ctx.meta.get("tidal.config_file")
        if param is None or path is None or ctx.get_parameter_source(param.name).name != "DEFAULT_MAP":
            raise
        raise type(exc)(f"config file {path}: {match.group(1)}: {match.group(3)}") from None


def local_keys(ctx: click.Context) -> frozenset:
    """The keys this node set itself, on the command line or in the file (a cluster policy leaves them)."""
    return frozenset(key for key, param in options(ctx.command).items()
                     if ctx.get_parameter_source(param.name).name in ("COMMANDLINE", "DEFAULT_MAP"))

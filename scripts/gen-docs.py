#!/usr/bin/env python3
"""Write the generated pages of docs/ from the code they describe, so they cannot drift from it:

* ``docs/cli.md``: every ``tidal`` command, its options and help, from click itself;
* ``docs/api.md``: the agent's HTTP API, from its OpenAPI document (``agent/openapi.json``, what
  ``GET /openapi.json`` serves) and the authority table of ``agent/authority.py``;
* ``deploy/helm/tidal/values.schema.json``: the chart's values schema, whose ``agent.config`` is every
  flag of ``tidal agent`` (its config file's keys) with the flag's type and bounds, so Helm refuses a
  wrong value with its path before anything reaches a node.

    python3 scripts/gen-docs.py            # rewrite both
    python3 scripts/gen-docs.py --check    # exit 1 naming the page that is out of date (the docs test runs this)
"""

from __future__ import annotations

import json
import os
import sys
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def cli_page() -> str:
    import click

    from agent.cli import main

    out: List[str] = ["# CLI reference", "",
                      "Generated from the `tidal` command itself (`scripts/gen-docs.py`); `tidal COMMAND --help` "
                      "says the same. Every command that fails says one line, `tidal: error: ...`, and exits 2.", ""]

    def walk(command: click.Command, path: List[str]) -> None:
        ctx = click.Context(command, info_name=" ".join(path))
        if path != ["tidal"]:
            out.append(f"{'#' * min(len(path), 4)} `{' '.join(path)}`")
            out.append("")
            usage = command.get_usage(ctx).replace("Usage: ", "")
            out.append(f"```\n{usage}\n```")
            out.append("")
            import inspect

            help_text = inspect.cleandoc(command.help or "")
            if help_text:
                out.append(help_text.replace("\b\n", ""))
                out.append("")
            rows = []
            for param in command.get_params(ctx):
                record = param.get_help_record(ctx)
                if record is None:
                    continue
                names, text = record
                if names.startswith("-h, --help"):
                    continue
                rows.append(f"| `{names}` | {text.replace('|', '&#124;')} |")
            if rows:
                out.extend(["| option | meaning |", "|---|---|", *rows, ""])
        if isinstance(command, click.Group):
            for name in sorted(command.list_commands(ctx)):
                walk(command.get_command(ctx, name), path + [name])

    walk(main, ["tidal"])
    return "\n".join(out).rstrip() + "\n"


def api_page() -> str:
    from agent import authority

    with open(os.path.join(REPO, "agent", "openapi.json")) as handle:
        doc = json.load(handle)
    out = ["# HTTP API reference", "",
           "Generated from the agent's OpenAPI document (`agent/openapi.json`, served at `GET /openapi.json`; "
           "`scripts/gen-docs.py`). The fuzz tests check the agent against the same document "
           "(`tests/unit/test_api_openapi_fuzz.py`).", "",
           doc["info"]["description"], "",
           "## Who may call what", "",
           authority.__doc__.split("\n\n", 1)[1].strip(), ""]
    schemas = doc["components"]["schemas"]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            out.append(f"## `{method.upper()} {path}`")
            out.append("")
            out.append(op.get("summary", "").capitalize() + ".")
            out.append("")
            params = op.get("parameters") or []
            if params:
                out.extend(["| parameter | in | type | meaning |", "|---|---|---|---|"])
                for p in params:
                    schema = p.get("schema", {})
                    kind = schema.get("type", "") + (f" {schema['enum']}" if "enum" in schema else "")
                    out.append(f"| `{p['name']}` | {p['in']} | {kind} | {p.get('description', '')} |")
                out.append("")
            body = (op.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                out.append(f"Body: {_schema_text(body, schemas)}")
                out.append("")
            out.extend(["| status | when |", "|---|---|"])
            for code, response in op["responses"].items():
                out.append(f"| {code} | {response['description']} |")
            out.append("")
    out.extend(["## Request documents", ""])
    for name in ("DedicatedRequest", "SharedRequest", "ReclaimedRequest", "SystemRequest"):
        schema = schemas[name]
        fields = ", ".join(f"`{k}`" + (" (required)" if k in schema.get("required", []) else "")
                           for k in schema["properties"])
        out.append(f"* **{name}** (`qos: {schema['properties']['qos']['enum'][0]}`): {fields}")
    out.append("")
    out.append(schemas["Request"]["description"])
    return "\n".join(out).rstrip() + "\n"


def _schema_text(schema, schemas) -> str:
    ref = schema.get("$ref")
    if ref:
        name = ref.rsplit("/", 1)[1]
        target = schemas[name]
        if "oneOf" in target:
            return f"a {name} document (below)"
        fields = ", ".join(f"`{k}`" for k in target.get("properties", {}))
        return f"`{name}` {{{fields}}}"
    return f"`{json.dumps(schema)[:200]}`"


def _flag_schema(param) -> dict:
    """A JSON schema of what the config file takes for one flag (agent/configfile.py)."""
    import click

    kind = param.type
    if param.is_flag:
        one = {"type": "boolean"}
    elif isinstance(kind, click.Choice):
        one = {"type": "string", "enum": list(kind.choices)}
    elif isinstance(kind, (click.IntRange, click.FloatRange)):
        one = {"type": "integer" if isinstance(kind, click.IntRange) else "number"}
        if kind.min is not None:
            one["minimum"] = kind.min
        if kind.max is not None:
            one["maximum"] = kind.max
    elif kind is click.INT:
        one = {"type": "integer"}
    elif kind is click.FLOAT:
        one = {"type": "number"}
    else:
        one = {"type": "string"}
    if "JSON-ARGV" in (param.metavar or ""):  # an argument vector: a list, or the flag's JSON text
        argv = {"type": "array", "items": {"type": "string"}, "minItems": 1}
        one = {"anyOf": [one, argv]}
        if param.multiple:  # hook: STATE=JSON texts, or a mapping of state to argument vector
            return {"anyOf": [{"type": "array", "items": {"type": "string"}},
                              {"type": "object", "additionalProperties": argv}],
                    "description": (param.help or "").split(". ")[0]}
    if param.multiple:
        one = {"type": "array", "items": one}
    one["description"] = (param.help or "").split(". ")[0]
    return one


def chart_schema() -> str:
    from agent.cli import agent, cluster_lending
    from agent.configfile import options

    lending = {key: _flag_schema(param) for key, param in options(cluster_lending).items()}
    resources = {"type": "object", "properties": {"requests": {"type": "object"}, "limits": {"type": "object"}},
                 "additionalProperties": False}

    def obj(properties, required=()):
        out = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            out["required"] = list(required)
        return out

    config = obj({key: _flag_schema(param) for key, param in options(agent).items()})
    config["description"] = "The agent's config file (docs/configuration.md): a key per flag of `tidal agent`."
    schema = {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "Tidal's chart values (generated by scripts/gen-docs.py from the CLI: do not edit)",
        **obj({
            "image": obj({"repository": {"type": "string", "minLength": 1}, "tag": {"type": "string"},
                          "pullPolicy": {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]}}),
            "namespace": obj({"create": {"type": "boolean"}}),
            "agent": obj({
                "config": config,
                "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
                "tolerations": {"type": "array", "items": {"type": "object"}},
                "priorityClassName": {"type": "string"},
                "systemdBus": {"type": "boolean", "description": "systemd's bus in the agent's pod: holds its values "
                               "of the kubelet's pod slices (systemd cgroup driver)"},
                "resources": resources,
                "nri": obj({"enabled": {"type": "boolean"}, "resources": resources}),
            }),
            "extender": obj({"enabled": {"type": "boolean"}, "policy": {"type": "string", "enum": ["pack", "spread"]},
                             "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                             "tlsSecret": {"type": "string", "minLength": 1}, "resources": resources}),
            "scheduler": obj({"enabled": {"type": "boolean"}, "replicas": {"type": "integer", "minimum": 1},
                              "name": {"type": "string", "minLength": 1},
                              "policy": {"type": "string", "enum": ["pack", "spread"]},
                              "shards": {"type": "integer", "minimum": 1, "maximum": 64},
                              "bindWorkers": {"type": "integer", "minimum": 1, "maximum": 1024},
                              "podInitialBackoff": {"type": "number", "minimum": 0, "maximum": 3600},
                              "podMaxBackoff": {"type": "number", "minimum": 0, "maximum": 3600},
                              "metricsPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                              "resources": resources}),
            "metrics": obj({"enabled": {"type": "boolean"},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "tlsSecret": {"type": "string", "minLength": 1},
                            "staleAfter": {"type": "number", "minimum": 1, "maximum": 86400},
                            "resources": resources}),
            "lending": obj({"enabled": {"type": "boolean"}, "threshold": lending["threshold"],
                            "period": lending["period"], "resources": resources}),
            "monitoring": obj({"prometheusRule": obj({"enabled": {"type": "boolean"}}),
                               "dashboard": obj({"enabled": {"type": "boolean"}, "label": {"type": "string"}})}),
        }),
    }
    return json.dumps(schema, indent=2) + "\n"


PAGES = {"docs/cli.md": cli_page, "docs/api.md": api_page, "deploy/helm/tidal/values.schema.json": chart_schema}


def main(argv: List[str]) -> int:
    check = "--check" in argv
    stale = []
    for path, make in PAGES.items():
        text = make()
        target = os.path.join(REPO, path)
        current = open(target).read() if os.path.exists(target) else None
        if current != text:
            if check:
                stale.append(path)
            else:
                with open(target, "w") as handle:
                    handle.write(text)
                print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run: python3 scripts/gen-docs.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

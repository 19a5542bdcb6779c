#!/usr/bin/env python3
"""Write the generated pages of docs/ from the code they describe, so they cannot drift from it:

* ``docs/cli.md``: every ``tidal`` command, its options and help, from click itself;
* ``docs/api.md``: the agent's HTTP API, from its OpenAPI document (``agent/openapi.json``, what
  ``GET /openapi.json`` serves) and the authority table of ``agent/authority.py``.

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


PAGES = {"docs/cli.md": cli_page, "docs/api.md": api_page}


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

"""The documentation cannot rot unnoticed.

* The README is a door, not a notebook: at most 250 lines, and it links every page of docs/.
* Nothing refers outside the repository (a user's clone has no ``../shared``).
* Every relative link in README and docs/ leads to a file that exists (and an anchor to a heading).
* The generated pages (CLI and HTTP API references) are what the code says now.
* Every ``tidal`` command in a shell block of README or docs/ is one the CLI has, with options it has:
  a renamed or removed option fails here, not in a user's terminal.
* The blocks marked ``<!-- doc-test: run -->`` are run as written, in a scratch directory, and must
  exit 0 (those that need neither root nor a running agent).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, List, Tuple

import click
import pytest

from agent.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^\s*```(\w*)\s*$")


def blocks(path: Path) -> Iterator[Tuple[str, str, int, str]]:
    """(info string, text, first line number, the comment line just above it) of each fenced block."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match:
            start, info = i, match.group(1)
            above = lines[i - 1] if i else ""
            i += 1
            body = []
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            yield info, textwrap.dedent("\n".join(body)), start + 1, above
        i += 1


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}
    linked = set(re.findall(r"\]\(((?:docs/)[^)#]+)", readme))
    assert pages - linked == set(), f"pages of docs/ the README does not link: {sorted(pages - linked)}"
    assert "make run" in readme and "make test" in readme


def test_nothing_refers_outside_the_repository():
    offenders = []
    for path in [*PAGES, *ROOT.glob("agent/**/*.py"), *ROOT.glob("cluster/**/*.py"), *ROOT.glob("contracts/**/*.py"),
                 *ROOT.glob("tests/**/*.py"), ROOT / "Makefile"]:
        text = path.read_text()
        if path == Path(__file__):
            continue
        if "../shared" in text or re.search(r"(?<!docs/)ARCHITECTURE\.md", text):
            offenders.append(path.relative_to(ROOT).as_posix())
    assert not offenders, offenders


def anchors(path: Path) -> set:
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_somewhere(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, broken


def test_the_generated_references_are_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-docs.py"), "--check"], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def commands(text: str) -> Iterator[List[str]]:
    """Each ``tidal ...`` invocation in a shell block, as words, up to what the shell takes over."""
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        line = line.split(" #", 1)[0]
        for piece in re.split(r"\|\||&&|[|;]|\$\(", line):
            try:
                words = shlex.split(piece, comments=False)
            except ValueError:
                continue
            while words and words[0] in ("sudo", "sh", "-c", "exec"):
                words = words[1:]
            if words and words[0] == "tidal":
                yield [w for w in words if not w.startswith((">", "<"))]


def check_invocation(words: List[str]) -> str:
    """'' when the CLI has the command and every option given; else what is wrong."""
    command: click.Command = cli
    ctx = click.Context(cli, info_name="tidal")
    rest = words[1:]
    if any(w.startswith("[") for w in words):  # a usage line: placeholders end the command
        rest = rest[:next((i for i, w in enumerate(rest) if w.startswith("[") or w.isupper()), len(rest))]
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        sub = command.get_command(ctx, rest[0])
        if sub is None:
            return f"no command `{' '.join(words[:words.index(rest[0]) + 1])}`"
        command, rest = sub, rest[1:]
        ctx = click.Context(command, info_name=command.name, parent=ctx)
    known = {opt for param in command.params for opt in getattr(param, "opts", []) + getattr(param, "secondary_opts", [])}
    known |= {"--help", "-h"}
    for word in rest:
        if word == "--":
            break
        if word.startswith("--"):
            name = word.split("=", 1)[0]
            if name not in known:
                return f"`{' '.join(words)}`: {name} is not an option of `{command.name}`"
    return ""


def shell_blocks():
    for page in PAGES:
        for info, text, line, above in blocks(page):
            if info in ("sh", "bash", "console", ""):
                yield page, text, line, above


@pytest.mark.parametrize("page, text, line, above", list(shell_blocks()),
                         ids=lambda v: v.relative_to(ROOT).as_posix() if isinstance(v, Path) else None)
def test_every_tidal_command_in_the_docs_is_one_the_cli_has(page, text, line, above):
    problems = [problem for words in commands(text) if (problem := check_invocation(words))]
    assert not problems, f"{page.relative_to(ROOT)}:{line}: {problems}"


RUN = [(page, text, line) for page, text, line, above in shell_blocks() if "doc-test: run" in above]


def test_some_blocks_are_run():
    assert len(RUN) >= 3, "blocks marked <!-- doc-test: run -->"


@pytest.mark.parametrize("page, text, line", RUN, ids=lambda v: v.relative_to(ROOT).as_posix()
                         if isinstance(v, Path) else None)
def test_the_blocks_marked_to_run_run(page, text, line, tmp_path):
    from agent.topology.synthetic import Shape, write_tree

    # what a block may name: a captured tree at ./node, and the repository's fixtures at tests/
    write_tree(str(tmp_path / "node"), Shape(sockets=1, numa_per_socket=2, cores_per_numa=4, threads_per_core=2))
    os.symlink(ROOT / "tests", tmp_path / "tests")
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    done = subprocess.run(["sh", "-ec", text], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{page.relative_to(ROOT)}:{line}:\n{text}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"

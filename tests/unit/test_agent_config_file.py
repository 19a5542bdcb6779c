"""The agent's config file (agent/configfile.py): a key per flag, flags over the file over the defaults,
one line naming the key for every mistake, and the shipped file as the systemd unit uses it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from agent.cli import agent as agent_command
from agent.cli import main
from agent.client import AgentClient
from agent.configfile import SKIP, options
from agent.topology.synthetic import Shape, write_tree

ROOT = Path(__file__).resolve().parents[2]


def effective(*args):
    result = CliRunner().invoke(main, ["agent", *args, "--print-config", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_every_flag_has_a_key():
    keys = options(agent_command)
    flags = [p for p in agent_command.params if p.name not in SKIP]
    assert len(keys) == len(flags) >= 45
    assert {"reserved-cpus", "no-resize", "offline-cgroup", "hook", "io-pressure-threshold"} <= set(keys)


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("period: 0.5\nreserved-cpus: '0'\nno-resize: true\noffline-cgroup: [/hadoop-yarn]\n"
                    "hook:\n  Offline: [/bin/true, now]\npush-command: [/bin/echo, hi]\n")
    doc = effective("--config", str(path), "--period", "2")
    values = doc["values"]
    assert doc["config_file"] == str(path)
    assert values["period"] == {"value": 2.0, "source": "flag"}
    assert values["reserved-cpus"] == {"value": "0", "source": "file"}
    assert values["no-resize"] == {"value": True, "source": "file"}
    assert values["offline-cgroup"] == {"value": ["/hadoop-yarn"], "source": "file"}
    assert values["hook"] == {"value": ['Offline=["/bin/true", "now"]'], "source": "file"}
    assert values["push-command"] == {"value": '["/bin/echo", "hi"]', "source": "file"}
    assert values["eviction-grace"] == {"value": 10.0, "source": "default"}
    # the YAML it prints is itself a config file that gives the same values
    printed = CliRunner().invoke(main, ["agent", "--config", str(path), "--period", "2", "--print-config"]).output
    again = tmp_path / "again.yaml"
    again.write_text(printed)
    replayed = effective("--config", str(again))["values"]
    assert {k: v["value"] for k, v in replayed.items()} == {k: v["value"] for k, v in values.items()}


@pytest.mark.parametrize("text, line", [
    ("perod: 1\n", "unknown key 'perod'"),
    ("reserved_cpus: '0'\n", "unknown key 'reserved_cpus' (did you mean reserved-cpus?)"),
    ("period: 0\n", "period: 0.0 is not in the range 0.01<=x<=3600."),
    ("period: .nan\n", "period: nan is not a finite number"),
    ("period: [1]\n", "period: one value, not a list"),
    ("period: true\n", "period: True is not a value of this flag"),
    ("no-resize: 1\n", "no-resize: true or false"),
    ("reserved-cpus:\n", "reserved-cpus: no value (leave the key out for the default)"),
    ("dedicated-partition: rooot\n", "dedicated-partition: 'rooot' is not one of 'root', 'isolated', 'none'."),
    ("tcp-port: 70000\n", "tcp-port: 70000 is not in the range 1<=x<=65535."),
    ("offline-cgroup: [{a: 1}]\n", "offline-cgroup: a list of values"),
    ("hook: {Offline: [1]}\n", "hook: Offline: an argument vector is a non-empty list of strings"),
    ("memory-evict-below: 5Q\n", "memory-evict-below: expected a size such as 512Mi or 1Gi, got '5Q'"),
    ("- period\n", "a mapping of flag names to values, not a list"),
    ("period: \"x\n", "not YAML (line 2, column 1)"),
    (b"\xff\xfe", "not UTF-8 text (byte 0)"),
], ids=lambda v: None)
def test_a_mistake_is_one_line_naming_the_file_and_the_key(tmp_path, text, line):
    path = tmp_path / "agent.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config", str(path), "--print-config"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tidal: error: config file {path}: {line}"), done.stderr


def test_a_missing_or_huge_file_is_refused(tmp_path):
    for path, line in ((tmp_path / "none.yaml", "No such file or directory"),
                       (tmp_path / "big.yaml", "larger than 1024 KiB")):
        if path.name == "big.yaml":
            path.write_text("# " + "x" * (1 << 20) + "\n")
        result = CliRunner().invoke(main, ["agent", "--config", str(path), "--print-config"])
        assert result.exit_code == 2 and f"config file {path}: {line}" in result.output, result.output


def test_the_shipped_file_is_what_the_unit_starts_with():
    unit = (ROOT / "systemd" / "tidal.service").read_text()
    assert "ExecStart=/opt/tidal/venv/bin/tidal agent --config /etc/tidal/agent.yaml\n" in unit
    assert "install -D -m 0644 systemd/agent.yaml $(CONFIG_DIR)/agent.yaml" in (ROOT / "Makefile").read_text()
    values = effective("--config", str(ROOT / "systemd" / "agent.yaml"))["values"]
    from_file = {k: v["value"] for k, v in values.items() if v["source"] == "file"}
    assert from_file["socket"] == "/run/tidal/tidal.sock" and from_file["state-dir"] == "/var/lib/tidal"
    # the shipped file states the defaults it names, but one: a host installed with the unit runs under
    # systemd, which holds the host's own units on the reserved cpus (make test-systemd runs it so)
    defaults = {k: v["value"] for k, v in effective()["values"].items()}
    assert from_file.pop("confine-host-units") == ["system.slice", "user.slice", "init.scope"]
    assert defaults["confine-host-units"] == []
    assert all(defaults[k] == v for k, v in from_file.items()), {k: (v, defaults[k]) for k, v in from_file.items()}


def test_an_agent_started_from_a_file_runs_with_its_values(tmp_path):
    write_tree(str(tmp_path / "root"), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    sock = tmp_path / "from-file.sock"
    config = tmp_path / "agent.yaml"
    config.write_text(f"root: {tmp_path / 'root'}\nsocket: {sock}\nstate-dir: {tmp_path / 'state'}\n"
                      f"cgroups-in-memory: true\nreserved-cpus: '1'\n")
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        proc.stdout.readline(), proc.stdout.readline()  # cgroups in memory; the node
        assert f"serving {sock}" in proc.stdout.readline()
        status = AgentClient(str(sock)).request("GET", "/v1/status")
        assert status["pools"]["reserved"] == "1", status["pools"]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0


def test_shell_completion_completes_commands_options_and_choices():
    import os

    env = dict(os.environ, _TIDAL_COMPLETE="bash_source")
    source = subprocess.run([sys.executable, "-m", "agent.cli"], env=env, capture_output=True, text=True, timeout=60)
    assert "_tidal_completion" in source.stdout or "complete -o nosort -F" in source.stdout, source.stdout[:500]

    def complete(words, cword):
        env = dict(os.environ, _TIDAL_COMPLETE="bash_complete", COMP_WORDS=words, COMP_CWORD=str(cword))
        done = subprocess.run([sys.executable, "-m", "agent.cli"], env=env, capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in done.stdout.splitlines()]

    assert complete("tidal sta", 1) == ["status"]
    assert complete("tidal agent --topology-policy ", 3) == ["none", "best-effort", "restricted", "single-numa-node"]
    assert "--print-config" in complete("tidal agent --pri", 2)

"""make bench-hierarchies: the cpu benchmarks on this host's cgroups and on pure cgroup v2, side by side.

Runs ``tidal bench cpu-isolation``, ``reaction`` and ``overhead`` here, then the
same commands with the same arguments inside the cgroup v2 VM of
``make test-cgroup2`` (scripts/cgroup2-vm.sh with TIDAL_VM_COMMAND), and prints
one JSON document: each benchmark's figures per hierarchy and the v2/v1 ratio
of each figure that has one. The VM runs under software emulation unless KVM
works, so its absolute times are slower; the ratios *within* a hierarchy
(p99 against the probe alone, harvest) are what compare directly.

Needs root. Progress goes to stderr; the document to stdout.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIDAL = os.path.join(REPO, ".venv", "bin", "tidal")
MARK = "@@tidal-bench "
BENCHES = {
    "cpu-isolation": ["--duration", "2", "--repeats", "6"],
    "reaction": ["--steps", "10"],
    "overhead": ["--workloads", "200", "--seconds", "30"],
}


def say(text: str) -> None:
    print(f"bench-hierarchies: {text}", file=sys.stderr, flush=True)


def host_run() -> dict:
    out = {}
    for name, args in BENCHES.items():
        say(f"host: tidal bench {name} {' '.join(args)}")
        start = time.monotonic()
        proc = subprocess.run([TIDAL, "bench", name, *args, "--json"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench-hierarchies: host bench {name} failed: {proc.stderr.strip()[-400:]}")
        out[name] = json.loads(proc.stdout)
        say(f"host: {name} took {time.monotonic() - start:.0f} s")
    return out


def vm_run() -> dict:
    lines = [f"echo '{MARK}{name}'; {shlex.quote(TIDAL)} bench {name} {' '.join(args)} --json"
             for name, args in BENCHES.items()]
    env = dict(os.environ, TIDAL_VM_COMMAND="; ".join(lines))
    say("cgroup v2 VM: booting (scripts/cgroup2-vm.sh) and running the same benchmarks")
    proc = subprocess.run(["sh", os.path.join(REPO, "scripts", "cgroup2-vm.sh")], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise SystemExit(f"bench-hierarchies: the VM run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    sys.stderr.write(proc.stderr)
    out, current, body = {}, None, []
    for line in proc.stdout.splitlines() + [MARK]:
        if line.startswith(MARK):
            if current is not None:
                out[current] = json.loads("\n".join(body))
            current, body = line[len(MARK):].strip() or None, []
        elif current is not None:
            body.append(line)
    missing = set(BENCHES) - set(out)
    if missing:
        raise SystemExit(f"bench-hierarchies: no result from the VM for {sorted(missing)}:\n{proc.stdout[-2000:]}")
    return out


def figures(name: str, result: dict) -> dict:
    """The figures compared: the ones each benchmark is about."""
    if name == "cpu-isolation":
        rows = {"alone_p99_us": result["alone"]["p99_us"]}
        for scenario, summary in result["scenarios"].items():
            rows[f"{scenario}_p99_ratio"] = summary["p99_ratio"]
            if "offline_harvest" in summary:
                rows[f"{scenario}_harvest"] = summary["offline_harvest"]
        return rows
    if name == "reaction":
        return {k: result[k] for k in ("p50_ms", "p99_ms", "max_ms")}
    return {k: result[k] for k in ("cpu_percent", "rss_mib", "last_reconcile_ms")}


def main() -> None:
    if os.geteuid() != 0:
        raise SystemExit("bench-hierarchies: needs root (real cgroups here and in the VM)")
    host = host_run()
    vm = vm_run()
    table = {}
    for name in BENCHES:
        a, b = figures(name, host[name]), figures(name, vm[name])
        table[name] = {key: {f"v{host[name]['cgroup_version']}": a[key], f"v{vm[name]['cgroup_version']}": b[key],
                             "ratio_v2_v1": round(b[key] / a[key], 2) if a[key] else None}
                       for key in a if key in b}
    print(json.dumps({"host": {"kernel": host["reaction"]["kernel"], "cgroup_version": host["reaction"]["cgroup_version"]},
                      "vm": {"kernel": vm["reaction"]["kernel"], "cgroup_version": vm["reaction"]["cgroup_version"]},
                      "compared": table, "raw": {"host": host, "vm": vm}}, indent=1))


if __name__ == "__main__":
    main()

"""The layers of docs/architecture.md hold: read from the source, not trusted.

The import rules are read from that page's "Layer rules" table (a rule written there is enforced
here; one removed there is no longer); the rest is listed below.


* ``contracts`` imports neither ``agent`` nor ``cluster`` (both sides import it);
* ``agent/reporter`` imports neither ``agent.k8s`` nor ``cluster``;
* ``agent/api`` does not import ``agent.daemon`` (it serves any object with the agent's methods);
* ``agent/qrm`` (policy) imports no isolation, reporter, k8s, daemon or cluster code;
* only ``agent/isolation`` writes the kernel: nowhere else names a cgroup control file in code,
  runs ``tc``/``nft``, or uses pyroute2; and nowhere else opens a file for writing, except the
  places listed below, each with what it writes;
* the rules both sides apply have one home in ``contracts``: no other module spells the eviction order
  of tiers (``contracts/eviction.py``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agent", "cluster", "contracts", "kube", "common")

# the benchmark lab builds its own network namespaces, emulated links and test processes
# (not Tidal's enforcement, which it measures through the agent's own code); it is the one
# place besides agent/isolation that runs tc and moves its test processes into a cgroup
LAB = {"agent/bench/netlab.py", "agent/bench/net_isolation.py", "agent/bench/reaction.py"}
WRITERS = {
    "agent/statefiles.py": "the one atomic write of the state directory",
    "agent/topology/synthetic.py": "synthetic sysfs trees for tests and benchmarks",
    "agent/bench/wakeup.py": "the PM QoS request (/dev/cpu_dma_latency) a benchmark holds",
    "agent/bench/netlab.py": "a benchmark process joins its own test cgroup",
    "agent/bench/memory_isolation.py": "the benchmark's data files (the working set and the stream it reads)",
    "cluster/extender/server.py": "recorded scheduler bodies (--record-dir)",
    "kube/localplane.py": "a local control plane's own files (token list, kubeconfig, configs) in its temp dir",
    "cluster/scheduler/bench.py": "kube-scheduler's configuration for the benchmark, in the plane's temp dir",
    "agent/topology/capture.py": "a captured sysfs/procfs tree, in the operator's new directory (--capture)",
}
KERNEL_FILE = re.compile(r"^(cgroup\.(procs|subtree_control|threads)|cpuset\.(cpus|mems)(\.partition)?|"
                         r"cpu\.(max|idle|shares|weight|cfs_quota_us|cfs_period_us)|"
                         r"memory\.(max|high|low|min|limit_in_bytes|soft_limit_in_bytes)|io\.max)$")


def sources() -> Iterator[Tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            yield rel, ast.parse(path.read_text(), rel)


def imports(tree: ast.Module) -> Set[str]:
    found: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def docstrings(tree: ast.Module) -> Set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            ids.add(id(body[0].value))
    return ids


def documented_rules() -> List[Tuple[str, Tuple[str, ...]]]:
    """The rows of docs/architecture.md's layer-rules table: (module prefix, modules it may not import)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layering-rules", 1)[1].split("<!-- end layering-rules -->", 1)[0]
    rules = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rules.append((cells[0].strip("`"), tuple(c.strip().strip("`") for c in cells[1].split(","))))
    return rules


RULES = documented_rules()


def test_the_documented_rules_keep_at_least_these():
    """The table is read, and none of these rules has gone from it (more may be added)."""
    assert set(RULES) >= {
        ("contracts/", ("agent", "cluster", "kube")),
        ("kube/", ("agent", "cluster")),
        ("cluster/", ("agent",)),
        ("agent/reporter/", ("agent.k8s", "cluster", "agent.daemon")),
        ("agent/api.py", ("agent.daemon",)),
        ("agent/qrm/", ("agent.isolation", "agent.reporter", "agent.k8s", "agent.daemon", "cluster")),
        ("agent/isolation/", ("agent.reporter", "agent.k8s", "agent.daemon", "cluster")),
    }


@pytest.mark.parametrize("prefix, forbidden", RULES, ids=[r[0].rstrip("/") for r in RULES])
def test_imports_follow_the_layers(prefix, forbidden):
    offenders: List[str] = []
    for rel, tree in sources():
        if not rel.startswith(prefix):
            continue
        for name in imports(tree):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                offenders.append(f"{rel} imports {name}")
    assert not offenders, offenders


def _is_write_open(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name == "open" and isinstance(func, ast.Name) or (name == "open" and isinstance(func, ast.Attribute)
                                                         and getattr(func.value, "id", "") in ("io", "builtins")):
        mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
        return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and bool(set(mode.value) & set("wax+"))
    if name == "open" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "os":
        return any(isinstance(n, ast.Attribute) and n.attr in ("O_WRONLY", "O_RDWR") for n in ast.walk(node))
    if name in ("write_text", "write_bytes"):
        return True
    return False


def test_only_isolation_writes_the_kernel():
    offenders: List[str] = []
    for rel, tree in sources():
        if rel.startswith("agent/isolation/"):
            continue
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if KERNEL_FILE.match(node.value) and rel not in LAB:
                    offenders.append(f"{rel}:{node.lineno} names kernel file {node.value!r}")
                if node.value in ("tc", "nft") and rel not in LAB:
                    offenders.append(f"{rel}:{node.lineno} runs {node.value}")
            if isinstance(node, ast.Call) and _is_write_open(node) and rel not in WRITERS:
                offenders.append(f"{rel}:{node.lineno} opens a file for writing")
        if rel not in LAB and any(n == "pyroute2" or n.startswith("pyroute2.") for n in imports(tree)):
            offenders.append(f"{rel} imports pyroute2")
    assert not offenders, offenders


def test_the_write_list_has_no_stale_entries():
    """Every allowed writer still writes: the list cannot quietly grow into a loophole."""
    writing = set()
    for rel, tree in sources():
        if any(isinstance(n, ast.Call) and _is_write_open(n) for n in ast.walk(tree)):
            writing.add(rel)
    assert set(WRITERS) <= writing, set(WRITERS) - writing


def test_the_agent_has_the_face_the_api_serves():
    """api.py serves a protocol, not daemon.py: the agent must keep every method of it."""
    from agent.api import AgentFace
    from agent.daemon import Agent

    wanted = [name for name in dir(AgentFace) if not name.startswith("_")]
    missing = [name for name in wanted if not hasattr(Agent, name) and name not in AgentFace.__annotations__]
    assert not missing, missing
    assert {"status", "admit", "release", "attach", "lend", "take_back", "owner_of"} <= set(wanted)


# the benchmarks build their own test boxes (cgroups they made themselves) and move their own test
# processes there; every other move or signal of a process through a driver is isolation.membership's
MOVERS = {"agent/bench/cpu_isolation.py", "agent/bench/memory_isolation.py", "agent/bench/numa_usage.py",
          "agent/bench/reserved.py"}


def test_only_isolation_moves_or_signals_processes_through_a_driver():
    offenders: List[str] = []
    for rel, tree in sources():
        if rel.startswith("agent/isolation/") or rel in MOVERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("move", "kill", "join_offline", "repair_membership"):
                target = ast.unparse(node.func.value)
                if "driver" in target or "rooted" in target or "root_view" in target:
                    offenders.append(f"{rel}:{node.lineno} {target}.{node.func.attr}(...)")
    assert not offenders, offenders


# one road to the kernel: every cgroup file is written by the Reconciler, from the desired tree (with
# originals kept and drift repaired); the driver itself writes only as part of its own operations
KNOB_WRITERS = {"agent/isolation/cgroups/reconcile.py", "agent/isolation/cgroups/driver.py"}


def test_only_the_reconciler_writes_cgroup_files_through_a_driver():
    offenders: List[str] = []
    for rel, tree in sources():
        if rel in KNOB_WRITERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write":
                target = ast.unparse(node.func.value)
                if "driver" in target or "rooted" in target or "root_view" in target:
                    offenders.append(f"{rel}:{node.lineno} {target}.write(...)")
    assert not offenders, offenders


def test_the_movers_list_has_no_stale_entries():
    moving = set()
    for rel, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "move" \
                    and "driver" in ast.unparse(node.func.value):
                moving.add(rel)
    assert MOVERS <= moving, MOVERS - moving


def test_the_eviction_order_has_one_home():
    """No module but contracts/eviction.py writes the tiers in an order (a copy of the rule: the day's
    stand-in once kept one, held equal to the agent's by a test)."""
    tiers = {"low", "min", "high"}
    offenders: List[str] = []
    for rel, tree in sources():
        if rel == "contracts/eviction.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) == 3 and \
                    {getattr(e, "value", None) for e in node.elts} == tiers:
                offenders.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders

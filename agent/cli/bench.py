"""``tidal bench``: the benchmarks (each prints JSON)."""

from __future__ import annotations

import json
import os
from typing import Optional, Tuple

import click

from agent.errors import TidalError
from agent.cli import FiniteRange, ROOT_OPTION, _Group, emit_json, main


ROOT_DIR_OPTION = click.option(
    "--shapes", "shapes_dir", default=None, type=click.Path(file_okay=False),
    help="Captured trees to make nodes of: a directory of sysfs trees (tidal topology --capture), or of "
         "hwloc's *.tar.bz2 test trees (default: tests/fixtures/hwloc of this checkout).")


def _tree_sources(directory: Optional[str]) -> dict:
    """``{name: archive or directory}`` of the machines captured under ``directory`` (default: the hwloc
    fixtures), nothing extracted yet."""
    import glob

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    directory = directory or os.path.join(here, "tests", "fixtures", "hwloc")
    if not os.path.isdir(directory):
        raise TidalError(f"--shapes {directory}: no such directory")
    archives = {os.path.basename(a)[:-len(".tar.bz2")]: a
                for a in sorted(glob.glob(os.path.join(directory, "*.tar.bz2")))}
    sources = archives or {e: os.path.join(directory, e) for e in sorted(os.listdir(directory))
                           if os.path.isdir(os.path.join(directory, e, "sys"))}
    if not sources:
        raise TidalError(f"--shapes {directory}: no captured trees (*.tar.bz2 or directories with sys/)")
    return sources


def _captured_trees(directory: Optional[str], only: Optional[str] = None) -> dict:
    """``{name: root}`` of the machines under ``directory`` (archives extracted into a temporary dir, ~120 MB
    in all); ``only``: that machine alone, the others neither extracted nor read (an unknown name is one
    error line that lists the machines)."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    sources = _tree_sources(directory)
    if only is not None:
        if only not in sources:
            raise TidalError(f"--shape {only}: not among the machines ({', '.join(sources)})")
        sources = {only: sources[only]}
    roots = {name: path for name, path in sources.items() if not path.endswith(".tar.bz2")}
    archives = {name: path for name, path in sources.items() if path.endswith(".tar.bz2")}
    if archives:
        work = tempfile.mkdtemp(prefix="tidal-shapes-")
        atexit.register(shutil.rmtree, work, True)  # the trees are read until the bench ends
        for name, archive in archives.items():
            expected = archive[:-len(".tar.bz2")] + ".expected.json"
            done = subprocess.run(["tar", "-xjf", archive, "-C", work], capture_output=True, text=True)
            if done.returncode != 0:
                said = (done.stderr.strip().splitlines() or ["no output"])[0]
                raise TidalError(f"--shapes: {archive}: not a tree tar could extract ({said})")
            root = json.load(open(expected))["root"] if os.path.exists(expected) else name
            roots[name] = os.path.join(work, root)
    return roots


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


@bench.command("net-isolation")
@click.option("--link-mbps", default=200, show_default=True, type=click.IntRange(1, 10000),
              help="Rate the emulated link is held to.")
@click.option("--seconds", default=4.0, show_default=True, type=FiniteRange(1, 600), help="Length of each run.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 100),
              help="Rounds of (unloaded, none, tidal, tidal_shaper_only), interleaved; p99 is over all rounds' "
                   "samples (5 rounds of 4 s: 10,000 per scenario).")
@click.option("--rr-rate", default=500.0, show_default=True, type=FiniteRange(1, 20000),
              help="Online requests per second.")
@click.option("--pm-qos/--no-pm-qos", default=True, show_default=True,
              help="Hold idle cpus awake (PM QoS, /dev/cpu_dma_latency = 0) for the whole run, every scenario alike: "
                   "on a VM, waking a halted vCPU goes through the hypervisor.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_net_isolation(link_mbps: int, seconds: float, repeats: int, rr_rate: float, pm_qos: bool,
                        as_json: bool) -> None:
    """Online latency under an offline flood: no shaping vs Tidal, in namespaces it makes (root)."""
    from agent.bench.net_isolation import run

    emit_json(run(link_mbps, seconds, repeats, rr_rate, pm_qos=pm_qos,
                  progress=lambda line: click.echo(line, err=True)))


@bench.command("placement")
@click.option("--nodes", default=10000, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--pods", default=100000, show_default=True, type=click.IntRange(1, 10_000_000))
@click.option("--baseline-pods", default=2000, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Pods the per-node loop places (its rate per pod does not depend on the count).")
@click.option("--policy", default="pack", show_default=True, type=click.Choice(["pack", "spread"]))
@click.option("--seed", default=1, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_placement(nodes: int, pods: int, baseline_pods: int, policy: str, seed: int, as_json: bool) -> None:
    """Cluster placement pods/s (NUMA-aware, vectorised) beside a per-node loop doing the same checks."""
    from cluster.placement.bench import run

    emit_json(run(nodes, pods, baseline_pods, policy, seed))


@bench.command("extender")
@click.option("--nodes", default=5000, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--calls", default=300, show_default=True, type=click.IntRange(10, 100_000))
@click.option("--client", default="auto", show_default=True, type=click.Choice(["auto", "go", "python"]),
              help="Who calls the extender: a Go client (as kube-scheduler does; needs go) or Python.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_extender(nodes: int, calls: int, client: str, as_json: bool) -> None:
    """Scheduler-extender filter+prioritize latency per call with N candidate nodes (HTTP, loopback)."""
    from cluster.extender_bench import run

    emit_json(run(nodes, calls, client=client))


@bench.command("scheduler")
@click.option("--nodes", default=1000, show_default=True, type=click.IntRange(1, 100_000),
              help="KWOK nodes, made from the shapes of real machines.")
@click.option("--pods", default=5000, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--mode", default="backlog", show_default=True, type=click.Choice(["backlog", "stream"]),
              help="backlog: pods created first, then each scheduler runs (its own throughput); stream: pods "
                   "created at --rate while it runs (creation-to-binding latency).")
@click.option("--rate", default=None, type=FiniteRange(1, 1_000_000),
              help="Pods created a second in stream mode (default: as fast as the API server takes them).")
@click.option("--numa-share", default=0.1, show_default=True, type=FiniteRange(0, 1),
              help="Share of the pods that are dedicated and NUMA-bound (2 cpus, 2 GiB in one zone).")
@click.option("--shards", "shards", multiple=True, type=click.IntRange(1, 64),
              help="Tidal scheduler instances (--shards of tidal cluster scheduler); repeat it to run Tidal once per "
                   "count, side by side (default: 1).")
@click.option("--only", "only", default=None, type=click.Choice(["kube-scheduler", "tidal"]),
              help="Run one scheduler only.")
@ROOT_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON; progress on stderr).")
def bench_scheduler(nodes: int, pods: int, mode: str, rate, numa_share: float, shards: Tuple[int, ...], only, shapes_dir,
                    as_json: bool) -> None:
    """kube-scheduler and Tidal's scheduler on one API server with N KWOK nodes: pods/s, latency, cpu."""
    from agent.bench.fleet import shapes as fleet_shapes
    from cluster.scheduler import bench
    from cluster.scheduler.fleet import kwok_testbin
    from kube.rest import ApiError

    try:
        kwok_testbin("tidal bench scheduler")  # before ~120 MB of trees are extracted for nothing
    except RuntimeError as exc:
        raise TidalError(str(exc)) from None
    roots = _captured_trees(shapes_dir)
    try:
        result = bench.run(fleet_shapes(roots), nodes, pods, mode, rate, numa_share, shards or (1,),
                           (only,) if only else ("kube-scheduler", "tidal"),
                           progress=lambda line: click.echo(f"tidal bench scheduler: {line}", err=True))
    except (RuntimeError, TimeoutError, ApiError) as exc:
        raise TidalError(str(exc)) from None
    emit_json(result)


@bench.command("day")
@click.option("--nodes", default=6, show_default=True, type=click.IntRange(2, 1000),
              help="KWOK nodes, all of one machine's shape.")
@click.option("--shape", default="16amd64-8n2c", show_default=True,
              help="The machine (a name under --shapes) the nodes are made from.")
@click.option("--seconds-per-minute", default=0.2, show_default=True, type=FiniteRange(0.01, 60),
              help="Wall seconds per day minute (0.2: the day in 288 s; the HPA's 5-minute scale-down window 1 s).")
@click.option("--lending-period", default=30, show_default=True, type=click.IntRange(1, 1440),
              help="Day minutes between the lending controller's passes.")
@click.option("--hours", default=24.0, show_default=True, type=FiniteRange(1, 24 * 7))
@click.option("--threshold", default=0.9, show_default=True, type=FiniteRange(0.01, 1),
              help="The lending controller's water level threshold.")
@click.option("--notice", default=5, show_default=True, type=click.IntRange(0, 1440),
              help="Day minutes of a lending or take-back notice (the nodes' agents'; with --offline).")
@click.option("--offline/--no-offline", default=True, show_default=True,
              help="Run the simulator's offline jobs through the day (Tidal's scheduler places them).")
@click.option("--hpa/--no-hpa", "autoscaler", default=True, show_default=True,
              help="Scale online with a HorizontalPodAutoscaler on its pods' cpu (served by the bench through the "
                   "resource metrics API); --no-hpa sets the simulator's replicas minute by minute.")
@click.option("--metrics-gap", default=None, metavar="HH:MM-HH:MM",
              help="Minutes of the day when the HPA's metrics have no measurement (with --hpa).")
@click.option("--fallback/--no-fallback", default=True, show_default=True,
              help="In a metrics gap, show yesterday's use of the same minute (else nothing: the HPA holds).")
@click.option("--trace", "trace_path", default=None, type=click.Path(dir_okay=False),
              help="Run this CSV trace's day (tidal cluster simulate's format: online demand in cores for the whole "
                   "cluster, offline jobs) instead of the synthetic one; node-K is the day's K-th node.")
@ROOT_DIR_OPTION
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON; progress on stderr).")
def bench_day(nodes: int, shape: str, seconds_per_minute: float, lending_period: int, hours: float, threshold: float,
              notice: int, offline: bool, autoscaler: bool, metrics_gap: Optional[str], fallback: bool,
              trace_path: Optional[str], shapes_dir, as_json: bool) -> None:
    """A day compressed onto a local control plane with KWOK nodes, beside the simulator's prediction: the
    online replicas it asks for, the lending controller as shipped, offline jobs on Tidal's scheduler over
    what the nodes' agents' rules offer; nodes lent, utilization and offline work, both ways."""
    from agent.bench.fleet import shapes as fleet_shapes
    from cluster import day
    from cluster.lending import parse_window
    from cluster.scheduler.fleet import Fleet, kwok_testbin
    from cluster.simulate import read_trace
    from kube.localplane import ControlPlane
    from kube.rest import ApiError
    from kubernetes.client.exceptions import ApiException

    if metrics_gap is not None:
        if not autoscaler:
            raise TidalError("--metrics-gap: the metrics are the HPA's (drop --no-hpa)")
        try:
            parse_window(metrics_gap)
        except TidalError:
            raise TidalError(f"--metrics-gap {metrics_gap!r}: expected HH:MM-HH:MM within 00:00-23:59") from None
    machines = _tree_sources(shapes_dir)
    if shape not in machines:
        raise TidalError(f"--shape {shape}: not among the machines ({', '.join(machines)})")
    trace = read_trace(trace_path, nodes) if trace_path else None
    try:
        binaries, kwok = kwok_testbin("tidal bench day")
    except RuntimeError as exc:
        raise TidalError(str(exc)) from None
    # every flag is checked first: only then is the one machine's tree extracted (the others are not)
    shapes = {s["name"]: s for s in fleet_shapes(_captured_trees(shapes_dir, only=shape))}
    if shape not in shapes:
        raise TidalError(f"--shape {shape}: no cpu or memory left once its reserved pool is set aside")
    say = lambda line: click.echo(f"tidal bench day: {line}", err=True)  # noqa: E731
    import urllib3

    # the control plane is this command's own, on loopback, with a certificate it made: nothing to verify
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    plane = ControlPlane(binaries).start()
    fleet = Fleet(plane, kwok)
    try:
        plane.start_controller_manager(**day.controllers(seconds_per_minute))
        plane.start_default_scheduler()
        fleet.install_crds()
        fleet.start_kwok()
        result = day.bench(plane, fleet, shapes[shape], nodes=nodes, seconds_per_minute=seconds_per_minute,
                           lending_period=lending_period, hours=hours, threshold=threshold, notice=notice,
                           offline=offline, autoscaler=autoscaler, metrics_gap=metrics_gap, fallback=fallback,
                           trace=trace, progress=say)
    except (RuntimeError, TimeoutError, ApiError, ApiException) as exc:
        raise TidalError(str(exc)) from None
    finally:
        fleet.stop()
        plane.stop()
    emit_json(result)


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


@bench.command("cpu-isolation")
@click.option("--duration", default=2.0, show_default=True, type=FiniteRange(0.5, 600),
              help="Seconds each scenario runs per round.")
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(1, 100),
              help="Rounds; in each the scenarios take turns.")
@click.option("--period-ms", default=5.0, show_default=True, type=FiniteRange(0.5, 1000),
              help="The probe's request period.")
@click.option("--work-us", default=300, show_default=True, type=click.IntRange(10, 100000),
              help="Fixed work per probe request.")
@click.option("--foreign-load", metavar="SLICE", default=None,
              help="Also run Tidal beside a foreign load (one 50%-duty process per cpu) in this systemd slice "
                   "(system.slice), the slice on every cpu and held on the reserved cpus (systemd hosts; run "
                   "the bench outside that slice: see docs/benchmarks); 'cgroup' on a host without systemd: "
                   "the load in a cgroup of the bench's own, held with --confine-host-cgroups.")
@click.option("--treatments", default=None, metavar="NAME,...",
              help="Run only these beside alone: none, besteffort, static_split, tidal, and with --foreign-load "
                   "tidal_foreign, tidal_foreign_confined (default: all).")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_cpu_isolation(duration: float, repeats: int, period_ms: float, work_us: int, foreign_load, treatments,
                        as_json: bool) -> None:
    """Online latency vs offline harvest: none, BestEffort, static split, Tidal (needs root)."""
    from agent.bench.cpu_isolation import run

    chosen = [t.strip() for t in treatments.split(",") if t.strip()] if treatments is not None else None
    if chosen is not None and not chosen:
        raise click.BadParameter("name at least one treatment", param_hint="--treatments")
    emit_json(run(duration, repeats, period_ms, work_us, foreign_load=foreign_load, treatments=chosen))


@bench.command("memory-isolation")
@click.option("--box", "box_mib", default=512, show_default=True, type=click.IntRange(256, 1 << 20),
              help="MiB of the node: a memory-limited cgroup the whole run lives in.")
@click.option("--online-anon", "online_anon_mib", default=64, show_default=True, type=click.IntRange(1, 1 << 20),
              help="MiB of anonymous memory in the online service's working set.")
@click.option("--online-file", "online_file_mib", default=64, show_default=True, type=click.IntRange(1, 1 << 20),
              help="MiB of page cache (a file it reads) in its working set.")
@click.option("--offline-share", default=0.8, show_default=True, type=FiniteRange(0.05, 2.0),
              help="The offline job's anonymous memory as a share of what online leaves.")
@click.option("--duration", default=10.0, show_default=True, type=FiniteRange(1, 600),
              help="Seconds each scenario runs per round.")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1, 50),
              help="Rounds; in each the scenarios take turns.")
@click.option("--dir", "directory", default="/var/tmp", show_default=True,
              type=click.Path(exists=True, file_okay=False, writable=True),
              help="Where the files go: a disk-backed filesystem (not tmpfs).")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_memory_isolation(box_mib: int, online_anon_mib: int, online_file_mib: int, offline_share: float,
                           duration: float, repeats: int, directory: str, as_json: bool) -> None:
    """Online latency, faults and OOM kills vs offline memory harvest: none, a plain limit, Tidal (needs root)."""
    from agent.bench.memory_isolation import run

    emit_json(run(box_mib=box_mib, online_anon_mib=online_anon_mib, online_file_mib=online_file_mib,
                  offline_share=offline_share, duration=duration, repeats=repeats, directory=directory,
                  progress=lambda line: click.echo(f"memory-isolation: {line}", err=True)))


@bench.command("reaction")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1, 1000))
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_reaction(steps: int, as_json: bool) -> None:
    """Online load step -> the reclaim pool shrunk in the kernel (needs root)."""
    from agent.bench.reaction import run

    emit_json(run(steps))


@bench.command("reserved")
@click.option("--seconds", default=3.0, show_default=True, type=FiniteRange(0.5, 600), help="Length of a round.")
@click.option("--repeats", default=4, show_default=True, type=click.IntRange(1, 100))
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_reserved(seconds: float, repeats: int, as_json: bool) -> None:
    """A system daemon's and the agent's latency with kernel-heavy reclaimed work kept off the reserved
    cpus, and on them (needs root)."""
    from agent.bench.reserved import run

    emit_json(run(seconds, repeats))


@bench.command("cpu-burst")
@click.option("--seconds", default=20.0, show_default=True, type=FiniteRange(2, 600), help="Length of a round.")
@click.option("--repeats", default=2, show_default=True, type=click.IntRange(1, 100))
@click.option("--limit-millicpu", default=200, show_default=True, type=click.IntRange(10, 100000),
              help="The service's cpu limit (its quota a 100 ms period).")
@click.option("--gap-ms", default=500.0, show_default=True, type=FiniteRange(1, 60000),
              help="Mean time between requests (exponential).")
@click.option("--cost-ms", default=30.0, show_default=True, type=FiniteRange(0.1, 10000),
              help="Cpu time a request costs.")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_cpu_burst(seconds: float, repeats: int, limit_millicpu: int, gap_ms: float, cost_ms: float,
                    as_json: bool) -> None:
    """A bursty online service under a cpu limit, with the agent's cpu burst and without (needs root)."""
    from agent.bench.cpu_burst import run

    emit_json(run(seconds, repeats, limit_millicpu, gap_ms, cost_ms))


@bench.command("overhead")
@click.option("--workloads", default=200, show_default=True, type=click.IntRange(1, 5000))
@click.option("--seconds", default=30.0, show_default=True, type=FiniteRange(5, 3600))
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_overhead(workloads: int, seconds: float, as_json: bool) -> None:
    """The agent's own cpu and memory at steady state with N workloads (needs root)."""
    from agent.bench.overhead import run

    emit_json(run(workloads, seconds))


@bench.command("numa-usage")
@click.option("--seconds", default=20.0, show_default=True, type=FiniteRange(2, 3600))
@click.option("--period", default=1.0, show_default=True, type=FiniteRange(0.2, 60),
              help="Seconds between samples (the agent's period).")
@click.option("--json", "as_json", is_flag=True, help="JSON output (always JSON).")
def bench_numa_usage(seconds: float, period: float, as_json: bool) -> None:
    """The v2 per-cpu offline estimate against v1's per-cpu counters on one load (needs root, v1)."""
    from agent.bench.numa_usage import run

    emit_json(run(seconds, period))

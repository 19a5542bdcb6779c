"""Tidal beside the peers a platform team would run instead, on the same real node with the same load, in
one run (the node tier's benchmark: ``tidal bench cpu-isolation``'s latency probe and cpu hogs, here as pods
of the real kubelet and containerd).

Rows, each with its configuration written next to its figures:

* ``none``: the kubelet as shipped (``cpuManagerPolicy: none``), the probe a Burstable pod asking 200m, the
  batch a BestEffort pod (the kubelet's own treatment of batch: ``cpu.shares`` 2);
* ``kubelet-static``: the kubelet's static CPU manager, its ``reservedSystemCPUs`` the cpus Tidal reserves
  by default (the node's first core, where the tier's control plane runs), the probe Guaranteed on a whole
  cpu of its own, the batch BestEffort (on the shared pool, the reserved cpus included);
* ``koordlet``: Koordinator's node agent (built by scripts/koordlet.sh; where it cannot be, the row says
  what refused) with its NodeSLO's CPU suppression on, the probe LS, the batch BE;
* ``tidal``: the kubelet as shipped and Tidal's DaemonSet from its chart with every default, the probe a
  ``shared_cores`` pod asking 200m, the batch a ``reclaimed_cores`` pod.

Each row: the probe (a 300 us request every 5 ms, its work calibrated once by this process before anything
runs) alone under the row's configuration (its reference: where each peer puts it differs), then beside the
batch pod's two spinning containers. Its latency percentiles, their ratios to alone, and offline's harvest:
the batch pod's cpu time (its pod cgroup's ``cpuacct.usage``) over the cpu time the probe left (cpus x
seconds - the probe's own); and the cpu the node's agents took meanwhile (the kubelet, where the static
policy runs; koordlet's process or Tidal's pod). Where each ran is read from the kernel
(``Cpus_allowed_list``), not from any agent's word.

What is asserted is what each row must be to be the row it says (the probes ran their whole time; static
gave the probe a cpu the batch did not have; Tidal's batch stayed off the reserved cpus; koordlet set its
suppression); the figures are a benchmark's, printed as one JSON document (and written to
``$TIDAL_PEERS_OUT`` when set), never asserted: these machines are noisy. docs/benchmarks/README.md keeps a
run's table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import psutil
import pytest

from agent.bench.cpu_isolation import calibrate
from agent.client import AgentClient
from common.process import terminate
from common.timing import percentile
from tests.conftest import privileged
from tests.k8s.controlplane import free_port, wait_for
from tests.node.harness import API_ADDRESS, BUSYBOX_IMAGE, KUBELET_ROOT, RealNode
from tests.node.test_node import (AGENT_SOCKET, REPO, agent_pod, allowed, container_pids, install_tidal,
                                  pod_cpuset_dir, real_node)

pytestmark = [pytest.mark.node, privileged]

PERIOD_MS, WORK_US = 5.0, 300
SECONDS = float(os.environ.get("TIDAL_PEERS_SECONDS", "15"))
LEAD_S = 15.0  # from the probe pod's creation to its start: room for the kubelet to start its container
SPIN = "while true; do :; done"
KOORDINATOR_VERSION = os.environ.get("KOORDINATOR_VERSION", "v1.8.0")  # scripts/koordlet.sh builds it


@pytest.fixture(scope="module")
def bare_node():
    """A real node with the kubelet as shipped and nothing of Tidal's on it yet."""
    with real_node() as real:
        yield real


def kubelet_config(node: RealNode, policy: str, read_only_port: int = 0) -> str:
    """The kubelet restarted with ``cpuManagerPolicy: policy`` (static: the reserved cpus its
    ``reservedSystemCPUs``), its cpu manager checkpoint removed as the kubelet requires on a change of
    policy; no pod may be running. ``read_only_port``: the kubelet's unauthenticated read-only port on the
    node's address (koordlet reads its pods there), else none and the kubelet on loopback as the harness
    starts it. Returns the configuration lines that differ from the harness's."""
    path = f"{node.dir}/kubelet/config.yaml"
    with open(path) as handle:
        text = handle.read()
    lines = f"cpuManagerPolicy: {policy}\n"
    if policy == "static":
        lines += f"reservedSystemCPUs: \"{','.join(str(c) for c in sorted(node.reserved))}\"\n"
    text = re.sub(r"cpuManagerPolicy: \w+\n(reservedSystemCPUs: .*\n)?", lines, text)
    text = re.sub(r"\nreadOnlyPort: \d+\n", f"\nreadOnlyPort: {read_only_port}\n", text)
    text = re.sub(r"\naddress: \S+\n", f"\naddress: {API_ADDRESS if read_only_port else '127.0.0.1'}\n", text)
    if read_only_port:
        lines += f"readOnlyPort: {read_only_port}\naddress: {API_ADDRESS}\n"
    with open(path, "w") as handle:
        handle.write(text)
    checkpoint = os.path.join(KUBELET_ROOT, "cpu_manager_state")
    if os.path.exists(checkpoint):
        os.unlink(checkpoint)
    node.restart("kubelet")  # returns once its health endpoint answers

    def policy_in_force() -> bool:
        if not os.path.exists(checkpoint):
            return False
        with open(checkpoint) as handle:
            return json.load(handle)["policyName"] == policy

    wait_for(policy_in_force, f"the kubelet's cpu manager checkpoint to say {policy}", timeout=60)
    return "; ".join(lines.strip().splitlines())


def create(node: RealNode, name: str, containers: List[Dict[str, Any]], annotations: Optional[Dict[str, str]] = None,
           restart: str = "Always", labels: Optional[Dict[str, str]] = None) -> None:
    doc = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}, "labels": labels or {}},
           "spec": {"hostNetwork": True, "terminationGracePeriodSeconds": 1, "restartPolicy": restart,
                    "containers": containers}}
    node.kubectl("create", "-f", "-", input=json.dumps(doc), check=True)


def running(node: RealNode, name: str, containers: int) -> Dict[str, int]:
    def ready():
        doc = node.get("pod", name)
        pids = container_pids(node, doc) if doc["status"].get("phase") == "Running" else {}
        pids.pop("(sandbox)", None)
        return pids if len(pids) == containers else None

    return wait_for(ready, f"pod {name}'s containers running", timeout=90)


def cpu_usage_ns(node: RealNode, name: str) -> int:
    directory = pod_cpuset_dir(node.get("pod", name)).replace("/cpuset/", "/cpuacct/")
    with open(f"{directory}/cpuacct.usage") as handle:
        return int(handle.read())


def container_log(node: RealNode, doc: Dict[str, Any], container: str) -> List[str]:
    """A container's output lines from the kubelet's log file (the CRI format: time, stream, P for a part of a
    long line or F for its end, the text), read on the node: ``kubectl logs`` would reach the kubelet by the
    node's name, which nothing here resolves."""
    meta = doc["metadata"]
    path = f"{node.dir}/kubelet/pod-logs/{meta['namespace']}_{meta['name']}_{meta['uid']}/{container}/0.log"
    lines, part = [], ""
    with open(path) as handle:
        for line in handle:
            fields = line.rstrip("\n").split(" ", 3)
            if len(fields) < 3:
                continue
            part += fields[3] if len(fields) > 3 else ""
            if fields[2] == "F":
                lines.append(part)
                part = ""
    return lines


def process_cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def probe_run(node: RealNode, loops: int, probe: Dict[str, Any], batch: bool,
              agent_cpu_s: Optional[Callable[[], float]] = None) -> Dict[str, Any]:
    """The probe pod (``probe``: its resources, annotations, labels) started at a set time, beside the batch
    pod where ``batch``: its figures, the cpu time the batch pod took meanwhile, and where each ran (the
    batch's read at the end: the kubelet's static policy moves a running container off a cpu it gives away
    exclusively on its next reconcile, within 10 s)."""
    found: Dict[str, Any] = {}
    start_at = time.time() + LEAD_S
    create(node, "probe", [{"name": "probe", "image": node.image_name, "imagePullPolicy": "Never",
                            "command": ["python3", "-m", "agent.bench.cpu_isolation", "probe", str(PERIOD_MS),
                                        str(WORK_US), str(SECONDS), f"{start_at:.3f}", str(loops)],
                            "resources": probe.get("resources", {})}], probe.get("annotations"), restart="Never",
           labels=probe.get("labels"))
    probe_pid = running(node, "probe", 1)["probe"]
    assert time.time() < start_at, "the probe's container started after its start time: raise LEAD_S"
    found["probe_cpus"] = sorted(allowed(probe_pid))
    time.sleep(max(0.0, start_at - time.time()))
    before = cpu_usage_ns(node, "batch") if batch else None
    kubelet = node.plane.procs["kubelet"].pid
    costs = (process_cpu_s(kubelet), agent_cpu_s() if agent_cpu_s else None)
    time.sleep(SECONDS)
    # what the node's own agents took meanwhile: the kubelet (the static policy is its), and koordlet or Tidal
    found["kubelet_cpu_share"] = round((process_cpu_s(kubelet) - costs[0]) / SECONDS, 4)
    if agent_cpu_s:
        found["agent_cpu_share"] = round((agent_cpu_s() - costs[1]) / SECONDS, 4)
    if batch:
        found["batch_cpu_s"] = (cpu_usage_ns(node, "batch") - before) / 1e9
        found["batch_cpus"] = sorted(set().union(*(allowed(pid) for pid in running(node, "batch", 2).values())))
    wait_for(lambda: node.get("pod", "probe")["status"].get("phase") in ("Succeeded", "Failed"), "the probe's end",
             timeout=SECONDS + 60)
    doc = node.get("pod", "probe")
    assert doc["status"]["phase"] == "Succeeded", container_log(node, doc, "probe")[-5:]
    result = json.loads(container_log(node, doc, "probe")[-1])
    found["latencies_us"] = result["latencies_us"]
    found["probe_cpu_s"] = result["cpu_s"]
    node.kubectl("delete", "pod", "probe", "--wait=true", "--timeout=90s")
    return found


def treatment(node: RealNode, loops: int, probe: Dict[str, Any], batch: Dict[str, Any]) -> Dict[str, Any]:
    """One row: the probe alone under the treatment (its own reference), then the batch pod (``batch``: its
    resources, annotations, labels, and what to wait for once it runs) spinning two containers and the
    probe again beside it."""
    alone = probe_run(node, loops, probe, batch=False)
    create(node, "batch", [{"name": f"spin{i}", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                            "command": ["sh", "-c", SPIN], "resources": batch.get("resources", {})}
                           for i in range(2)], batch.get("annotations"), labels=batch.get("labels"))
    running(node, "batch", 2)
    if batch.get("settle"):
        batch["settle"]()
    beside = probe_run(node, loops, probe, batch=True, agent_cpu_s=batch.get("agent_cpu_s"))
    node.kubectl("delete", "pods", "--all", "-n", "default", "--wait=true", "--timeout=90s")
    return {"alone": alone, "beside": beside}


def figures(found: Dict[str, Any], cpus: int) -> Dict[str, Any]:
    """A row's figures: the probe's percentiles alone and beside the batch, the ratios, the harvest."""
    def percentiles(lat: List[float]) -> Dict[str, float]:
        return {"p50_us": round(percentile(lat, 50), 1), "p99_us": round(percentile(lat, 99), 1),
                "p999_us": round(percentile(lat, 99.9), 1)}

    alone, beside = found["alone"], found["beside"]
    out: Dict[str, Any] = {"alone": percentiles(alone["latencies_us"]), **percentiles(beside["latencies_us"])}
    out["p50_ratio"] = round(out["p50_us"] / out["alone"]["p50_us"], 3)
    out["p99_ratio"] = round(out["p99_us"] / out["alone"]["p99_us"], 3)
    idle = cpus * SECONDS - beside["probe_cpu_s"]
    out.update(offline_harvest=round(beside["batch_cpu_s"] / idle, 3), batch_cpu_s=round(beside["batch_cpu_s"], 2),
               samples=len(beside["latencies_us"]), probe_cpus=beside["probe_cpus"], batch_cpus=beside["batch_cpus"],
               kubelet_cpu_share=beside["kubelet_cpu_share"])
    if "agent_cpu_share" in beside:
        out["agent_cpu_share"] = beside["agent_cpu_share"]
    return out


def koordlet_build() -> Tuple[Optional[str], Optional[str]]:
    """The koordlet cache directory (scripts/koordlet.sh builds it where missing), or why there is none."""
    done = subprocess.run(["sh", f"{REPO}/scripts/koordlet.sh"], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if not line.startswith("koordlet: building")]
        return None, f"not built: scripts/koordlet.sh: {' '.join(' '.join(said).split())[-400:] or done.returncode}"
    return done.stdout.strip(), None


def koordlet_row(node: RealNode, loops: int, probe: Dict[str, Any]) -> Dict[str, Any]:
    """Koordinator's koordlet on the node, as its DaemonSet runs it (here a host process with the host's
    paths for its container mounts), with what it needs of koord-manager: its CRDs and the node's NodeSLO,
    CPU suppression on at Koordinator's default threshold. The probe LS, the batch BE (a BestEffort pod,
    labelled BE). Its cpuset policy keeps at least two cpus for BE work (``beMinCPUSetCores``), which on
    this 2-cpu node is every cpu: it would suppress nothing; the row runs the cfsQuota policy, which caps
    the BestEffort tree's quota at what the threshold leaves."""
    directory, refused = koordlet_build()
    policy = "cfsQuota"
    configuration = (f"kubelet cpuManagerPolicy: none; koordlet {KOORDINATOR_VERSION} (NodeSLO "
                     f"resourceUsedThresholdWithBE: enable, cpuSuppressThresholdPercent 65, cpuSuppressPolicy "
                     f"{policy}); the probe LS (Burstable, 200m), the batch BE (BestEffort)")
    if refused:
        return {"configuration": configuration, "not_run": refused}
    crds = [f"{directory}/src/config/crd/bases/{name}.yaml" for name in (
        "slo.koordinator.sh_nodeslos", "slo.koordinator.sh_nodemetrics", "scheduling.koordinator.sh_devices",
        "topology.node.k8s.io_noderesourcetopologies")]
    for crd in crds:
        node.kubectl("apply", "--server-side", "--force-conflicts", "-f", crd, check=True)
    wait_for(lambda: node.kubectl("get", "nodeslos").returncode == 0, "koordinator's CRDs served", timeout=60)
    slo = {"apiVersion": "slo.koordinator.sh/v1alpha1", "kind": "NodeSLO", "metadata": {"name": node.name},
           "spec": {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 65,
                                                    "cpuSuppressPolicy": policy}}}
    node.kubectl("create", "-f", "-", input=json.dumps(slo), check=True)
    port, metrics = free_port(), free_port()
    kubelet_config(node, "none", read_only_port=port)
    state = f"{node.dir}/koordlet"
    for sub in ("etc-hookserver", "prediction", "var-run"):
        os.makedirs(f"{state}/{sub}", exist_ok=True)
    argv = [f"{directory}/koordlet", f"--kubeconfig={node.kubeconfig}", "--cgroup-root-dir=/sys/fs/cgroup/",
            "--proc-root-dir=/proc/", "--sys-root-dir=/sys/", "--sys-fs-root-dir=/sys/fs/", "--run-root-dir=/run/",
            f"--var-run-root-dir={state}/var-run/", f"--var-lib-kubelet-dir={KUBELET_ROOT}/",
            f"--containerd-endpoint={node.containerd_socket}", "--enable-nri-runtime-hook=false",
            f"--runtime-hooks-addr={state}/koordlet.sock", f"--runtime-hooks-host-endpoint={state}/koordlet.sock",
            f"--runtime-hooks-config-path={state}/etc-hookserver/",
            "--kubelet-insecure-tls", f"--kubelet-read-only-port={port}", "--disable-query-kubelet-config",
            f"--addr=127.0.0.1:{metrics}", f"--pprof-addr=127.0.0.1:{free_port()}", f"--tsdb-path={state}/tsdb/",
            f"--prediction-checkpoint-filepath={state}/prediction", "--v=4"]
    proc = node._spawn("koordlet", argv, env=dict(os.environ, NODE_NAME=node.name))
    besteffort = "/sys/fs/cgroup/cpu/kubepods/besteffort"
    try:
        import urllib.request

        def suppressing():
            assert proc.poll() is None, f"koordlet exited:\n{node.log('koordlet', 30)}"
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
            return [line for line in text.splitlines() if line.startswith("koordlet_be_suppress_cpu_cores")] or None

        def settle():  # the batch pod spinning and koordlet's suppression in its tree's quota
            wait_for(suppressing, "koordlet's BE suppression", timeout=120, interval=1)
            with open(f"{besteffort}/cpu.cfs_quota_us") as handle:
                assert int(handle.read()) > 0, "koordlet did not set the BestEffort tree's quota"

        found = treatment(node, loops, {**probe, "labels": {"koordinator.sh/qosClass": "LS"}},
                          {"settle": settle, "labels": {"koordinator.sh/qosClass": "BE"},
                           "agent_cpu_s": lambda: process_cpu_s(proc.pid)})
        return {"configuration": configuration, "found": found, "suppression": suppressing()}
    finally:
        terminate(node.plane.procs.pop("koordlet", None))
        # what koordlet leaves: the BestEffort tree's quota; its objects (the NodeSLO, its NodeMetric and
        # topology report) and its CRDs but the topology one, which Tidal's chart shares
        if os.path.exists(f"{besteffort}/cpu.cfs_quota_us"):
            with open(f"{besteffort}/cpu.cfs_quota_us", "w") as handle:
                handle.write("-1")
        for kind in ("nodeslos", "nodemetrics", "noderesourcetopologies"):
            node.kubectl("delete", kind, "--all", "--wait=true")
        for crd in crds[:3]:
            node.kubectl("delete", "-f", crd, "--wait=true")


def test_tidal_beside_koordlet_the_kubelet_alone_and_its_static_policy_on_one_node(bare_node):
    node = bare_node
    cpus = len(node.every_cpu)
    loops = calibrate(WORK_US)  # on this process's cpu while nothing competes: the same work in every row
    shared_probe = {"resources": {"requests": {"cpu": "200m", "memory": "64Mi"}}}
    runs: Dict[str, Dict[str, Any]] = {}
    config: Dict[str, str] = {}

    runs["none"] = treatment(node, loops, shared_probe, {})
    config["none"] = ("kubelet cpuManagerPolicy: none; the probe Burstable (requests 200m), the batch BestEffort "
                      "(cpu.shares 2)")

    static = kubelet_config(node, "static")
    whole = {"resources": {"requests": {"cpu": "1", "memory": "64Mi"}, "limits": {"cpu": "1", "memory": "64Mi"}}}
    runs["kubelet-static"] = treatment(node, loops, whole, {})
    config["kubelet-static"] = (f"kubelet {static}; the probe Guaranteed (1 cpu, exclusive), the batch "
                                "BestEffort (the shared pool)")

    koordlet = koordlet_row(node, loops, shared_probe)
    if "found" in koordlet:
        runs["koordlet"] = koordlet.pop("found")
    config["koordlet"] = koordlet.pop("configuration")
    kubelet_config(node, "none")

    install_tidal(node)  # its chart with every default, the node's part
    wait_for(lambda: AgentClient(AGENT_SOCKET).request("GET", "/v1/capacity")["reclaimed"]["millicpu"] >= 200,
             "reclaimed capacity of at least 200 millicpu", timeout=180, interval=1)

    def settled() -> None:
        """the reclaimed pod off its probation (its first periods off online's idle cpus)"""
        def off() -> bool:
            status = AgentClient(AGENT_SOCKET).request("GET", "/v1/status")
            mine = [w["name"] for w in AgentClient(AGENT_SOCKET).request("GET", "/v1/workloads")["workloads"]
                    if w.get("label") == "default/batch"]
            kept = set(status["kernel_work"]["probation"]) | set(status["kernel_work"]["confined"])
            return bool(mine) and mine[0] not in kept

        wait_for(off, "the reclaimed pod off probation", timeout=60)

    agent_dir = pod_cpuset_dir(agent_pod(node)).replace("/cpuset/", "/cpuacct/")

    def agent_cpu_s() -> float:  # Tidal's pod: the agent and its NRI plugin
        with open(f"{agent_dir}/cpuacct.usage") as handle:
            return int(handle.read()) / 1e9

    reclaimed = {"resources": {"requests": {"cpu": "100m"}}, "settle": settled, "agent_cpu_s": agent_cpu_s,
                 "annotations": {"tidal.io/qos-level": "reclaimed_cores"}}
    runs["tidal"] = treatment(node, loops, shared_probe, reclaimed)
    config["tidal"] = ("kubelet cpuManagerPolicy: none; Tidal's DaemonSet (helm chart, defaults); the probe "
                       "shared_cores (Burstable, 200m), the batch reclaimed_cores (requests 100m)")

    rows = {name: {**figures(found, cpus), "configuration": config[name]} for name, found in runs.items()}
    rows.setdefault("koordlet", {"configuration": config["koordlet"]}).update(koordlet)
    report = {"rows": rows, "cpus": cpus, "reserved_cpus": sorted(node.reserved), "seconds": SECONDS,
              "period_ms": PERIOD_MS, "work_us": WORK_US, "kernel": os.uname().release, "cgroup_version": 1,
              "kubelet": os.path.basename(os.path.dirname(node.k8s_bin + "/"))}
    print(json.dumps(report))
    for name, figures_ in rows.items():
        if "p99_us" in figures_:
            print(f"{name:15} p50 {figures_['p50_us']:8.1f} us (x{figures_['p50_ratio']}) p99 {figures_['p99_us']:8.1f} us "
                  f"(x{figures_['p99_ratio']} of alone, {figures_['alone']['p99_us']} us), harvest "
                  f"{figures_['offline_harvest']:.3f}, probe on {figures_['probe_cpus']}, batch on {figures_['batch_cpus']}, "
                  f"kubelet {figures_['kubelet_cpu_share']:.3f} cpu, agent {figures_.get('agent_cpu_share', '-')} cpu")
        else:
            print(f"{name:15} not run: {figures_['not_run']}")
    if os.environ.get("TIDAL_PEERS_OUT"):
        with open(os.environ["TIDAL_PEERS_OUT"], "w") as handle:
            json.dump(report, handle, indent=1)

    expected = SECONDS * 1000 / PERIOD_MS
    for name, found in runs.items():  # each probe ran its whole time
        counts = [len(found[k]["latencies_us"]) for k in ("alone", "beside")]
        assert min(counts) >= 0.98 * expected, (name, counts)
        assert found["beside"]["batch_cpu_s"] > 0, name
    # each row is the configuration it names, by the kernel's word: static gave the probe a cpu of its own
    # the batch did not have, off the reserved ones; Tidal's batch stayed off the reserved cpus (it harvests
    # what online leaves of the pool, at the lowest priority under its quota); the kubelet alone let it anywhere
    static_row = rows["kubelet-static"]
    assert len(static_row["probe_cpus"]) == 1 and not set(static_row["probe_cpus"]) & set(static_row["batch_cpus"])
    assert not set(static_row["probe_cpus"]) & node.reserved
    assert set(rows["none"]["batch_cpus"]) == set(node.every_cpu)
    assert not set(rows["tidal"]["batch_cpus"]) & node.reserved
    # koordlet ran (where it could be built) and suppressed: its BestEffort tree under a quota it set
    if "koordlet" in runs:
        assert rows["koordlet"]["suppression"], rows["koordlet"]

"""`tidal agent --kube-node` as the DaemonSet runs it: a process, default settings, for minutes.

The defect of #16 hid behind in-process agents with a watch period no user
runs: the shipped agent released its pods' allocations after ~30 s. Here the
agent is started with the DaemonSet's own command line (read from
``deploy/agent-daemonset.yaml``) and every default, and must keep its pods.

Two nodes, one agent process each:

* ``hwloc``: an 8-NUMA-node machine (hwloc's 64amd64 snapshot), kernel writes
  recorded (no kubelet runs here): three NUMA-bound dedicated pods.
* ``host``: this machine, real cgroups (root only): one dedicated pod whose
  kubelet-layout cgroup holds a real process; the pod's cpuset is written by
  the agent's Reconciler and the process is confined to its cpu.

Arguments beyond the manifest's (and its ConfigMap, the agent's config file), each for a reason that
is not behaviour: ``--state-dir``/``--socket`` point at a temporary directory instead of the
host paths the manifest mounts; ``--kubeconfig`` because outside a pod there
is no service account; ``--root``/``--cgroups-in-memory`` for the hwloc node
(its topology is a snapshot, and no kubelet made its pods' cgroups);
``--cgroup-base tidal-test-<id>`` on the host so the test's tree has a unique
name that cleanup (and ``make clean-test-leftovers``) can find.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from tests.cgroup_trees import remove_cgroup_tree
from tests.conftest import is_root
from tests.k8s.controlplane import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")]

HOLD_SECONDS = 90  # three times the 30 s after which the old agent dropped its pods
HWLOC_MACHINE = "64amd64-4s2n4ca2co"  # 8 NUMA nodes x 8 cpus
CPUSET = "/sys/fs/cgroup/cpuset"


def daemonset_command(node: str, state_dir: str, socket_path: str):
    """The agent container's command from the shipped manifest, as a local process: its config file is
    the manifest's ConfigMap (written beside the state directory), and the flags after it move the
    paths that belong to a real installation (flags override the file, as they would there)."""
    with open("deploy/agent-daemonset.yaml") as handle:
        docs = [d for d in yaml.safe_load_all(handle) if d]
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    configmap = next(d for d in docs if d["kind"] == "ConfigMap")
    command = list(daemonset["spec"]["template"]["spec"]["containers"][0]["command"])
    assert command[:2] == ["tidal", "agent"], command
    argv = [a.replace("$(NODE_NAME)", node) for a in command[2:]]
    config = os.path.join(os.path.dirname(state_dir), f"{node}-agent.yaml")
    with open(config, "w") as handle:
        handle.write(configmap["data"]["agent.yaml"])
    argv[argv.index("--config") + 1] = config
    # the manifest's hostPath mounts (/var/lib/tidal, /run/tidal) belong to a real installation; the
    # plugin socket beside the agent's, one directory per agent (two agents here share a directory)
    argv += ["--state-dir", state_dir, "--socket", socket_path,
             "--plugin-socket", os.path.join(socket_path + ".plugin", "plugin.sock")]
    return [sys.executable, "-m", "agent.cli", "agent", *argv]


class AgentProcess:
    def __init__(self, name, argv, workdir):
        self.name = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.socket = argv[argv.index("--socket") + 1]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def workloads(self):
        from agent.client import AgentClient

        assert self.proc.poll() is None, f"agent {self.name} exited:\n{self.log()}"
        # a pod's workload is named pod/<uid>; tests know pods by <namespace>/<name>, its label
        return {w.get("label") or w["name"]: w
                for w in AgentClient(self.socket, timeout=10).request("GET", "/v1/workloads")["workloads"]}

    def log(self):
        with open(self.log_path) as handle:
            return handle.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def register_node(core, name, topo):
    from kubernetes import client

    memory = sum(n.memory_bytes or 0 for n in topo.numa_nodes)
    cpus = len(topo.online_cpus())
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels={"kubernetes.io/hostname": name})))
    status = {"capacity": {"cpu": str(cpus), "memory": str(memory), "pods": "110"},
              "allocatable": {"cpu": str(cpus), "memory": str(memory), "pods": "110"}}
    core.patch_node_status(name, {"status": status})


def bound_pod(name, node, cpus, numa):
    from kubernetes import client

    amounts = {"cpu": str(cpus), "memory": "1Gi"}
    annotations = {"tidal.io/numa-binding": "true"} if numa else {}
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name, annotations=annotations),
                        spec=client.V1PodSpec(node_name=node, containers=[client.V1Container(
                            name="c", image="pause", resources={"requests": amounts, "limits": amounts})]))


def nrt_cpu_free(api, node):
    from kubernetes import client

    from contracts.pods import quantity

    report = client.CustomObjectsApi(api).get_cluster_custom_object(
        "topology.node.k8s.io", "v1alpha2", "noderesourcetopologies", node)
    free = {}
    for zone in report["zones"]:
        cpu = next(r for r in zone["resources"] if r["name"] == "cpu")
        free[zone["name"]] = quantity(cpu["available"])
    return free


def api_requests(api):
    """The API server's own count of the requests it served, by (verb, resource): ``apiserver_request_total``
    from its /metrics, summed over the other labels."""
    import re

    from kube.rest import Rest

    status, body = Rest.from_config(api.configuration, "tidal-test").call("GET", "/metrics")
    assert status == 200, body[:200]
    counts = {}
    for line in body.decode().splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.rindex("}")]))
            key = (labels.get("verb"), labels.get("resource"))
            counts[key] = counts.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def _remove_test_tree(base):
    """Every hierarchy's ``base`` tree; the paths that stayed."""
    return [path for path in (os.path.join("/sys/fs/cgroup", root, base) for root in os.listdir("/sys/fs/cgroup"))
            if not remove_cgroup_tree(path)]


def test_the_daemonset_agent_keeps_its_pods_and_frees_them_on_deletion(plane, api, hwloc_trees, hwloc_topologies,
                                                                        tmp_path):
    from kubernetes import client, utils

    core = client.CoreV1Api(api)
    with open("deploy/crd-noderesourcetopology.yaml") as handle:
        utils.create_from_dict(api, yaml.safe_load(handle))
    tag = uuid.uuid4().hex[:6]
    kubeconfig = plane.kubeconfig()
    agents = {}
    hw_node = f"proc-hwloc-{tag}"
    register_node(core, hw_node, hwloc_topologies[HWLOC_MACHINE])
    argv = daemonset_command(hw_node, str(tmp_path / "hw-state"), str(tmp_path / "hw.sock"))
    agents["hwloc"] = AgentProcess("hwloc", argv + ["--kubeconfig", kubeconfig, "--root", hwloc_trees[HWLOC_MACHINE],
                                                    "--cgroups-in-memory"], str(tmp_path))
    real = is_root() and os.path.isdir(CPUSET) and not os.path.exists(f"{CPUSET}/kubepods")
    host_node, base, sleeper, made_kubepods = f"proc-host-{tag}", f"tidal-test-{tag}", None, False
    try:
        if real:
            from agent.topology import HostFS, discover

            register_node(core, host_node, discover(HostFS("/")))
            argv = daemonset_command(host_node, str(tmp_path / "host-state"), str(tmp_path / "host.sock"))
            agents["host"] = AgentProcess("host", argv + ["--kubeconfig", kubeconfig, "--cgroup-base", base],
                                          str(tmp_path))
        for agent in agents.values():
            wait_for(lambda agent=agent: agent.workloads() is not None, f"the {agent.name} agent to serve", timeout=60)
        wait_for(lambda: nrt_cpu_free(api, hw_node), "the hwloc node's first report")

        # three 4-cpu NUMA-bound Guaranteed pods bound to the hwloc node (the reproduction)
        names = [f"db-{tag}-{i}" for i in range(3)]
        for name in names:
            core.create_namespaced_pod("default", bound_pod(name, hw_node, 4, numa=True))
        held = wait_for(lambda: (lambda w: w if all(f"default/{n}" in w for n in names) else None)(
            agents["hwloc"].workloads()), "the three pods admitted")
        if real:
            # the kubelet's part, done by hand: the pod's cgroup (cgroupfs layout) with a process in it
            host_pod = core.create_namespaced_pod("default", bound_pod(f"solo-{tag}", host_node, 1, numa=False))
            uid = host_pod.metadata.uid
            made_kubepods = True
            pod_dir = f"{CPUSET}/kubepods/pod{uid}"
            os.makedirs(pod_dir)
            for directory in (f"{CPUSET}/kubepods", pod_dir):  # as runc does: a new cpuset starts with its parent's
                for knob in ("cpuset.mems", "cpuset.cpus"):
                    with open(f"{os.path.dirname(directory)}/{knob}") as src, open(f"{directory}/{knob}", "w") as dst:
                        dst.write(src.read().strip())
            sleeper = subprocess.Popen(["sleep", "600"])
            with open(f"{pod_dir}/cgroup.procs", "w") as handle:
                handle.write(str(sleeper.pid))
            solo = wait_for(lambda: agents["host"].workloads().get(f"default/solo-{tag}"), "the host pod admitted")
            wait_for(lambda: open(f"{pod_dir}/cpuset.cpus").read().strip() == solo["cpus"],
                     "the pod's cpuset written by the agent")
        start = time.monotonic()
        before = api_requests(api)
        time.sleep(HOLD_SECONDS)
        served = {key: round(count - before.get(key, 0)) for key, count in api_requests(api).items()
                  if count > before.get(key, 0)}
        # what the agents cost the API server while nothing changed (this test asks nothing meanwhile): their
        # Node and their pods are watched, each watch renewed from where it was (no relist), and nothing is
        # read each period (an agent that read its Node every second was 90 reads of etcd here)
        print(f"API requests over {HOLD_SECONDS} s, {len(agents)} agent(s):", json.dumps(
            {f"{verb} {resource}": n for (verb, resource), n in sorted(served.items())}))
        assert not {key: n for key, n in served.items() if key[0] in ("GET", "LIST") and key[1] in ("nodes", "pods")}, served

        # after 90 s with every default: still allocated, disjoint, and reported as taken
        now = agents["hwloc"].workloads()
        assert time.monotonic() - start >= HOLD_SECONDS
        assert all(f"default/{n}" in now for n in names), (sorted(now), agents["hwloc"].log())
        from agent.topology.parse import parse_cpulist

        cpu_sets = [set(parse_cpulist(now[f"default/{n}"]["cpus"])) for n in names]
        assert all(len(c) == 4 for c in cpu_sets)
        assert not (cpu_sets[0] & cpu_sets[1] or cpu_sets[0] & cpu_sets[2] or cpu_sets[1] & cpu_sets[2])
        assert {n: now[f"default/{n}"]["cpus"] for n in names} == {n: held[f"default/{n}"]["cpus"] for n in names}
        topo = hwloc_topologies[HWLOC_MACHINE]
        free = nrt_cpu_free(api, hw_node)
        for cpus in cpu_sets:
            (zone,) = {topo.numa_of(c) for c in cpus}  # NUMA-bound: one zone each
            assert free[f"node-{zone}"] <= len(topo.cpus_in_numa(zone)) - 4
        assert sum(len(topo.cpus_in_numa(n)) for n in topo.numa_ids()) - sum(free.values()) >= 12
        if real:
            solo_now = agents["host"].workloads()[f"default/solo-{tag}"]
            assert solo_now["cpus"] == solo["cpus"]
            assert open(f"{pod_dir}/cpuset.cpus").read().strip() == solo["cpus"]
            with open(f"/proc/{sleeper.pid}/status") as handle:
                allowed = next(line.split(":")[1].strip() for line in handle if line.startswith("Cpus_allowed_list"))
            assert allowed == solo["cpus"]  # the process in the kubelet's cgroup is confined to the pod's cpu

        # deleting a pod frees its cpus in the agent and in the report
        before = sum(free.values())
        core.delete_namespaced_pod(names[0], "default", grace_period_seconds=0)
        wait_for(lambda: f"default/{names[0]}" not in agents["hwloc"].workloads(), "the deleted pod released")
        wait_for(lambda: sum(nrt_cpu_free(api, hw_node).values()) >= before + 4, "the report to show its cpus free")
        assert all(f"default/{n}" in agents["hwloc"].workloads() for n in names[1:])
        if real:
            core.delete_namespaced_pod(f"solo-{tag}", "default", grace_period_seconds=0)
            wait_for(lambda: f"default/solo-{tag}" not in agents["host"].workloads(), "the host pod released")
    finally:
        codes = {name: agent.stop() for name, agent in agents.items()}
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        left = []
        if real:
            left = _remove_test_tree(base)
            if made_kubepods and not remove_cgroup_tree(f"{CPUSET}/kubepods"):
                left.append(f"{CPUSET}/kubepods")
    assert codes == {name: 0 for name in agents}, {name: agent.log() for name, agent in agents.items()}
    # a kubepods tree left on the host would stop the node tier (it takes it for a kubelet's)
    assert not left, f"cgroups the test made could not be removed: {left}"

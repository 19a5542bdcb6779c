"""The DaemonSet on the node users run (make test-systemd-kubelet): systemd as PID 1 on pure cgroup v2, a
kubelet >= 1.35 with the systemd cgroup driver and its cgroup v1 refusal as shipped (no failCgroupV1), and
containerd 2.x with NRI and ``SystemdCgroup = true``, both run as systemd units as a kubeadm node runs
them; the control plane on the host (tests/systemd/kubeplane.py). Tidal is installed with its Helm chart
and its image, as the node tier (tests/node) installs it on this project's cgroup v1 host.

What is read is what the kernel shows: each container's ``Cpus_allowed_list`` and its cgroup files. The
tests run in file order, one node and one install carried through them.
"""
import http.client
import glob
import json
import os
import shutil
import socket
import subprocess
import time

import pytest

pytestmark = pytest.mark.kubelet

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KUBECONFIG = os.environ.get("TIDAL_KUBECONFIG", "/mnt/out/kubeconfig")
KBIN, NBIN, HELM = "/mnt/kbin", "/mnt/nbin", "/mnt/helm/helm"
CGROUP = "/sys/fs/cgroup"
NODE = "tidal-vm"
PAUSE_IMAGE, BUSYBOX_IMAGE = "tidal.local/pause:1", "tidal.local/busybox:1"
AGENT_SOCKET = "/run/tidal/tidal.sock"
# the figures: a dedicated pod keeps exactly its cpus, and no value is rewritten back and forth, over
# 3 minutes of restarts and reloads
HOLD_SECONDS = float(os.environ.get("TIDAL_KUBELET_HOLD", "180"))

CONTAINERD_CONFIG = f"""version = 3
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  SystemdCgroup = true
  BinaryName = "/usr/local/sbin/runc"
[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = "/var/run/nri/nri.sock"
"""

# containerd's own unit (its repository's containerd.service), and the kubelet's as kubeadm's packages ship it
CONTAINERD_UNIT = """[Unit]
Description=containerd container runtime
After=network.target local-fs.target dbus.service
[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/local/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999
[Install]
WantedBy=multi-user.target
"""

KUBELET_UNIT = f"""[Unit]
Description=kubelet: The Kubernetes Node Agent
Wants=network-online.target containerd.service
After=network-online.target containerd.service
[Service]
ExecStart=/usr/local/bin/kubelet --config=/var/lib/kubelet/config.yaml --kubeconfig=/etc/kubernetes/kubelet.conf --hostname-override={NODE} --node-ip=10.0.2.15
Restart=always
RestartSec=2
[Install]
WantedBy=multi-user.target
"""

KUBELET_CONFIG = """apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
readOnlyPort: 0
authentication: {anonymous: {enabled: false}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
# the images were imported, not pulled: nothing may collect them
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}
cpuManagerPolicy: none
"""


def sh(*argv, check=True, timeout=300, input=None):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def kubectl(*args, check=True, input=None):
    return sh(f"{KBIN}/kubectl", f"--kubeconfig={KUBECONFIG}", *args, check=check, input=input)


def get(*args):
    return json.loads(kubectl("get", *args, "-o", "json"))


def ctr(*args, check=True):
    return sh(f"{NBIN}/ctr", "--namespace", "k8s.io", *args, check=check)


def wait_for(check, what, timeout=120.0, interval=0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (AssertionError, OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f} s ({last})")


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.path)


def agent(path):
    """The agent's local API as root on the node reads it (the DaemonSet's socket on the host's /run/tidal)."""
    conn = UnixHTTP(AGENT_SOCKET)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200, (path, response.status, body[:300])
        return json.loads(body)
    finally:
        conn.close()


def read(path):
    with open(path) as handle:
        return handle.read().strip()


def cpus(text):
    found = set()
    for part in text.split(","):
        if part:
            low, _, high = part.partition("-")
            found.update(range(int(low), int(high or low) + 1))
    return found


def allowed(pid):
    for line in read(f"/proc/{pid}/status").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return cpus(line.split(":", 1)[1].strip())
    raise AssertionError(f"pid {pid}: no Cpus_allowed_list")


def cgroup_of(pid):
    for line in read(f"/proc/{pid}/cgroup").splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"pid {pid}: no cgroup v2 line")


def tasks():
    found = {}
    for line in ctr("tasks", "list").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "RUNNING":
            found[fields[0]] = int(fields[1])
    return found


def pod(name, namespace="default"):
    return get("pod", name, "-n", namespace)


def work_pid(name):
    """The pod's running container's first process, once it runs."""
    def ready():
        doc = pod(name)
        status = (doc["status"].get("containerStatuses") or [{}])[0]
        cid = (status.get("containerID") or "").split("://")[-1]
        return tasks().get(cid) if doc["status"].get("phase") == "Running" and cid else None

    return wait_for(ready, f"pod {name} running", timeout=180)


def run_pod(name, cpu, *, limits=True, annotations=None, command="while true; do sleep 1; done"):
    resources = {"requests": {"cpu": cpu, "memory": "16Mi"}}
    if limits:
        resources["limits"] = dict(resources["requests"])
    doc = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}},
           "spec": {"hostNetwork": True, "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "work", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                                    "command": ["sh", "-c", command], "resources": resources}]}}
    kubectl("create", "-f", "-", input=json.dumps(doc))
    return work_pid(name)


def agent_pod():
    pods = get("pods", "-n", "tidal-system", "-l", "app.kubernetes.io/name=tidal-agent")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return live[0] if live else None


def agent_serves():
    doc = agent_pod()
    return doc and doc["status"].get("phase") == "Running" and agent("/v1/health")


def project_version():
    with open(os.path.join(REPO, "pyproject.toml")) as handle:
        return next(line.split('"')[1] for line in handle if line.startswith("version = "))


def install(source, target, mode=0o755):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copyfile(source, target)
    os.chmod(target, mode)


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(text)


@pytest.fixture(scope="module")
def node():
    """containerd and the kubelet installed and started as systemd units, the images imported, Tidal's chart
    installed; the units' journals printed when a test fails."""
    for name in ("containerd", "containerd-shim-runc-v2", "ctr"):
        install(f"{NBIN}/{name}", f"/usr/local/bin/{name}")
    runc = [n for n in os.listdir(NBIN) if n.startswith("runc-")]
    install(f"{NBIN}/{runc[0]}", "/usr/local/sbin/runc")
    install(f"{KBIN}/kubelet", "/usr/local/bin/kubelet")
    # the VM's minimal Debian has neither; every node has both (containerd copies /etc/hosts into each
    # hostNetwork sandbox and fails the pod without it; the kubelet gives pods the node's resolv.conf)
    if not os.path.exists("/etc/hosts"):
        write("/etc/hosts", f"127.0.0.1 localhost\n10.0.2.15 {NODE}\n::1 localhost ip6-localhost ip6-loopback\n")
    if not os.path.exists("/etc/resolv.conf"):
        write("/etc/resolv.conf", "nameserver 10.0.2.3\n")  # qemu's user network's resolver
    write("/etc/containerd/config.toml", CONTAINERD_CONFIG)
    write("/etc/systemd/system/containerd.service", CONTAINERD_UNIT)
    write("/etc/systemd/system/kubelet.service", KUBELET_UNIT)
    write("/var/lib/kubelet/config.yaml", KUBELET_CONFIG)
    install(KUBECONFIG, "/etc/kubernetes/kubelet.conf", 0o600)
    sh("systemctl", "daemon-reload")
    sh("systemctl", "enable", "--now", "containerd.service")
    started = time.monotonic()
    pause = [n for n in os.listdir(NBIN) if n.startswith("pause-") and n.endswith(".oci.tar")][0]
    for archive in (f"{NBIN}/{pause}", f"{NBIN}/busybox.oci.tar", f"{REPO}/dist/tidal_{project_version()}.oci.tar"):
        ctr("images", "import", archive)
    print(f"images imported in {time.monotonic() - started:.0f} s")
    sh("systemctl", "enable", "--now", "kubelet.service")
    wait_for(lambda: get("node", NODE), "the kubelet's Node", timeout=240, interval=2)
    helm = [HELM, "--kubeconfig", KUBECONFIG]
    # the node's part of the chart (as tests/node installs it): the cluster side is the Kubernetes tier's
    sh(*helm, "install", "tidal", f"{REPO}/deploy/helm/tidal", "--namespace", "tidal-system", "--create-namespace",
       "--set", "extender.enabled=false", "--set", "lending.enabled=false", "--set", "scheduler.enabled=false")
    try:
        wait_for(agent_serves, "the agent's DaemonSet pod serving", timeout=420, interval=2)
        yield
    except BaseException:
        for unit in ("kubelet", "containerd"):
            print(f"---- {unit}\n" + sh("journalctl", "-u", unit, "--no-pager", "-n", "40", check=False))
        # the kubelet's own files (the API server on the host cannot reach the node's kubelet for `kubectl logs`)
        for directory, _, files in os.walk("/var/log/pods"):
            for name in sorted(files):
                if directory.startswith("/var/log/pods/tidal-system_"):
                    print(f"---- {directory}/{name}\n" + "\n".join(read(f"{directory}/{name}").splitlines()[-30:]))
        raise


def test_the_kubelet_runs_with_the_systemd_driver_on_pure_v2(node):
    info = get("node", NODE)["status"]["nodeInfo"]
    major, minor = (int(x) for x in info["kubeletVersion"].lstrip("v").split(".")[:2])
    assert (major, minor) >= (1, 35), info
    assert info["containerRuntimeVersion"].startswith("containerd://2."), info
    assert os.path.isdir(f"{CGROUP}/kubepods.slice"), os.listdir(CGROUP)
    assert sh("systemctl", "is-active", "kubepods.slice").strip() == "active"
    doc = agent_pod()
    assert doc["status"]["containerStatuses"][0]["image"].endswith(f"tidal:{project_version()}")
    cid = doc["status"]["containerStatuses"][0]["containerID"].split("://")[-1]
    pid = tasks()[cid]
    uid = doc["metadata"]["uid"].replace("-", "_")
    # the agent stays in its pod's scope, which systemd made for runc
    path = cgroup_of(pid)
    assert path.endswith(f"-pod{uid}.slice/cri-containerd-{cid}.scope") and path.startswith("/kubepods.slice/"), path
    reserved = cpus(agent("/v1/status")["pools"]["reserved"])
    assert reserved
    wait_for(lambda: allowed(pid) == reserved, f"the agent on the reserved cpus {sorted(reserved)}", timeout=60)


BEFORE = {}


def millicpu(quantity):
    text = str(quantity)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def nrt_available():
    """The report's available cpu, in millicpu (reclaimed capacity makes it fractional: "2800m")."""
    report = get("noderesourcetopologies", NODE)
    return sum(millicpu(r["available"]) for z in report["zones"] for r in z["resources"] if r["name"] == "cpu")


def knobs(pid):
    """The values of the container's scope and its pod's slice that the kubelet, systemd and Tidal may write."""
    scope = f"{CGROUP}{cgroup_of(pid)}"
    found = {}
    for directory in (scope, os.path.dirname(scope)):
        for knob in ("cpuset.cpus", "cpu.weight", "cpu.idle", "cpu.max", "memory.low", "memory.min", "memory.high"):
            if os.path.exists(f"{directory}/{knob}"):
                found[f"{directory[len(CGROUP):]}/{knob}"] = read(f"{directory}/{knob}")
    return found


def test_pods_by_qos_through_restarts_and_reloads_with_no_value_rewritten_back(node):
    """A dedicated pod (Guaranteed, 1 cpu), a shared one and a reclaimed one; then, over HOLD_SECONDS, systemd
    reloads twice, the kubelet and containerd restart and the agent's pod is deleted (its DaemonSet makes a new
    one), while the kernel's values are sampled every half second: the dedicated pod keeps exactly its cpu
    throughout, and no value of the pods' scopes and slices is rewritten back to one it had before (a
    flip-flop: two writers undoing each other, the class of koordinator#1214)."""
    status = agent("/v1/status")
    reserved = cpus(status["pools"]["reserved"])
    BEFORE["nrt"] = wait_for(nrt_available, "the agent's NodeResourceTopology", timeout=120)
    dedicated = run_pod("dedicated", "1")
    mine = wait_for(lambda: allowed(dedicated) if len(allowed(dedicated)) == 1 and not allowed(dedicated) & reserved
                    else None, "the dedicated container pinned to one cpu off the reserved pool", timeout=60)
    shared = run_pod("shared", "200m", limits=False)
    shared_pool = wait_for(lambda: cpus(agent("/v1/status")["pools"]["shared"]), "a shared pool")
    wait_for(lambda: allowed(shared) == shared_pool, f"the shared pod on the shared pool {sorted(shared_pool)}",
             timeout=60)
    assert not shared_pool & mine
    # reclaimed work is admitted on what online leaves idle: the peak of the last 5 minutes, as shipped. The
    # node's own start (image imports, the kubelet, containerd and the agent starting under emulation, on every
    # cpu) is in that window at first; it leaves it 5 minutes after
    try:
        wait_for(lambda: agent("/v1/capacity")["reclaimed"]["millicpu"] >= 200, "reclaimed capacity", timeout=420,
                 interval=2)
    except AssertionError:
        print("capacity:", agent("/v1/capacity"))
        raise
    batch = run_pod("batch", "100m", limits=False,
                    annotations={"tidal.io/qos-level": "reclaimed_cores", "tidal.io/tier": "low"})
    batch_slice = os.path.dirname(f"{CGROUP}{cgroup_of(batch)}")
    wait_for(lambda: read(f"{batch_slice}/cpu.idle") == "1" and read(f"{batch_slice}/cpu.max").split()[0] != "max",
             "the reclaimed pod at cpu.idle under a quota", timeout=60)
    assert not allowed(batch) & mine, "reclaimed work on the dedicated cpu"
    # the report: less the dedicated cpu and the shared pod's request (reclaimed work takes none of it)
    wait_for(lambda: nrt_available() == BEFORE["nrt"] - 1000 - 200, "the report counting the dedicated cpu and "
             "the shared request", timeout=60)

    pids = {"dedicated": dedicated, "shared": shared, "batch": batch}
    history = {}  # (pod, knob) -> the distinct values in the order seen
    flips = []

    def sample():
        assert allowed(dedicated) == mine, f"the dedicated pod left its cpu: {sorted(allowed(dedicated))}"
        for name, pid in pids.items():
            for knob, value in knobs(pid).items():
                # the reclaimed pod's own quota follows what online leaves idle (Tidal's one writer moves it)
                if name == "batch" and knob.endswith("cpu.max"):
                    continue
                seen = history.setdefault((name, knob), [])
                if seen and seen[-1] != value:
                    if value in seen:
                        flips.append((time.monotonic() - started, name, knob, seen[-1], value))
                if not seen or seen[-1] != value:
                    seen.append(value)

    repairs_before = agent("/v1/status")["counters"]["drift_repairs"]
    disruptions = [(0.15, "daemon-reload"), (0.3, "kubelet"), (0.45, "containerd"), (0.6, "daemon-reload"),
                   (0.75, "agent pod")]
    started = time.monotonic()
    repairs_old_agent = None
    while time.monotonic() - started < HOLD_SECONDS:
        sample()
        elapsed = (time.monotonic() - started) / HOLD_SECONDS
        while disruptions and elapsed >= disruptions[0][0]:
            _, what = disruptions.pop(0)
            print(f"{time.monotonic() - started:.0f} s: {what}")
            if what == "daemon-reload":
                sh("systemctl", "daemon-reload")
            elif what in ("kubelet", "containerd"):
                sh("systemctl", "restart", f"{what}.service")
            else:
                repairs_old_agent = agent("/v1/status")["counters"]["drift_repairs"] - repairs_before
                old = agent_pod()["metadata"]["uid"]
                kubectl("delete", "pod", "-n", "tidal-system", agent_pod()["metadata"]["name"], "--wait=false")
                wait_for(lambda: agent_pod() and agent_pod()["metadata"]["uid"] != old and agent_serves(),
                         "a new agent pod serving", timeout=240, interval=1)
        time.sleep(0.5)
    assert not disruptions, f"not every disruption ran in {HOLD_SECONDS:.0f} s: {disruptions}"
    sample()
    repairs_new_agent = agent("/v1/status")["counters"]["drift_repairs"]
    changes = {key: seen for key, seen in history.items() if len(seen) > 1}
    print(f"values that changed over {HOLD_SECONDS:.0f} s: {changes}; drift repaired by the first agent "
          f"{repairs_old_agent}, by its successor {repairs_new_agent}")
    assert not flips, f"values rewritten back and forth: {flips}"
    # the new agent pod kept every pod as its workload (from the checkpoint: none released, none admitted anew)
    assert pod_workloads(*pids) <= pods_held(), (sorted(pod_workloads(*pids) - pods_held()), agent_log())
    assert repairs_old_agent == 0 and repairs_new_agent == 0, (repairs_old_agent, repairs_new_agent)
    for name, pid in pids.items():
        assert allowed(pid) & reserved == set() or name == "batch", (name, sorted(allowed(pid)))


def pods_held():
    """The agent's workloads, by name (a pod's is ``pod/<uid>``)."""
    return {w["name"] for w in agent("/v1/workloads")["workloads"]}


def pod_workloads(*names):
    return {f"pod/{get('pod', name)['metadata']['uid']}" for name in names}


def agent_log(lines=150):
    """The agent container's log as the kubelet keeps it on the node (the host's kubectl cannot reach the
    node's kubelet by name)."""
    found = sorted(glob.glob("/var/log/pods/tidal-system_tidal-agent-*/agent/*.log"), key=os.path.getmtime)
    if not found:
        return "(no agent log under /var/log/pods)"
    with open(found[-1], errors="replace") as handle:
        return "".join(handle.readlines()[-lines:])


def test_the_agent_reports_each_pods_use_from_the_systemd_drivers_scopes(node):
    """The NodeUsage report (what `tidal cluster metrics` serves to the HPA) under the systemd cgroup driver on
    pure v2: each running pod's container found in its ``cri-containerd-<id>.scope`` and read there (cpu.stat,
    memory.current less memory.stat's inactive_file), the working set no more than what the scope holds."""
    wanted = {"dedicated", "shared", "batch"}

    def report():
        usage = get("nodeusages", NODE)["usage"]
        pods = {p["name"]: p for p in usage["pods"] if p["namespace"] == "default"}
        return usage if wanted <= set(pods) else None

    usage = wait_for(report, "the agent's NodeUsage naming every pod", timeout=120, interval=2)
    assert 0 < usage["windowSeconds"] <= 60 and usage["node"]["memory"] > 0
    for pod in (p for p in usage["pods"] if p["name"] in wanted):
        (container,) = pod["containers"]
        assert container["name"] == "work" and container["cpu"] >= 0, pod
        scope = f"{CGROUP}{cgroup_of(work_pid(pod['name']))}"
        assert 0 < container["memory"] <= int(read(f"{scope}/memory.current")) + (8 << 20), (pod, scope)
        assert pod["uid"] == get("pod", pod["name"])["metadata"]["uid"]


def test_deleting_the_pods_frees_their_cpus_in_the_agent_and_the_report(node):
    mine = pod_workloads("dedicated", "shared", "batch")
    assert mine <= pods_held(), (sorted(mine - pods_held()), agent_log())
    kubectl("delete", "pod", "dedicated", "shared", "batch", "--wait=true", "--timeout=120s")
    try:
        wait_for(lambda: not pods_held() & mine, "the agent releasing the pods", timeout=60)
    except AssertionError:
        print("workloads:", sorted(pods_held()))
        print(agent_log())
        raise
    status = agent("/v1/status")
    assert not status["pools"]["dedicated"], status["pools"]
    wait_for(lambda: nrt_available() == BEFORE["nrt"], f"the report's {BEFORE['nrt']} millicpu available again",
             timeout=60)

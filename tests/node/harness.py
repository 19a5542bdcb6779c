"""A real Kubernetes node on this host: the control plane of the Kubernetes tier, kube-controller-manager
(the DaemonSet, service-account and root-CA controllers), the default kube-scheduler, containerd 2.x with
runc, and a kubelet, all started as their users start them, from ``make k8s-testbin`` and
``make node-testbin``; Tidal's image from ``make image``.

No registry and no CNI plugin: the images are imported from OCI archives (``ctr images import``), and
every pod of the tier uses the host's network (the DaemonSet does anyway). The API server listens on
the first address of the Service range, on 443, on a veth link this harness makes (198.19.254.1,
inside the 198.18.0.0/15 the tests may use): the ``kubernetes`` Service's ClusterIP is the server
itself, so a pod's in-cluster configuration reaches it with no kube-proxy.

The kubelet keeps its default root directory, /var/lib/kubelet (the agent reads the kubelet's
cpu_manager_state there, as on any node), and containerd NRI's default socket, /var/run/nri/nri.sock
(where the DaemonSet's plugin looks): the harness refuses to start where either is in use. What the
kubelet and containerd leave on the host (kubepods cgroups, mounts under those directories and the
harness's own, the hostPath directories of the DaemonSet) is removed by ``stop()``; after a killed
run, ``make clean-test-leftovers`` stops the processes and removes the cgroups, mounts and link, and
those host directories that hold the tier's mark (``.tidal-node-tier``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Dict, List, Optional

from tests.cgroup_trees import remove_cgroup_tree
from common.process import terminate
from tests.k8s.controlplane import ControlPlane, _tail, _wait, free_port

SERVICE_CIDR = "198.19.254.0/24"
API_ADDRESS = "198.19.254.1"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tidal")
CONTAINERD_VERSION = os.environ.get("CONTAINERD_VERSION", "2.2.9")
RUNC_VERSION = os.environ.get("RUNC_VERSION", "1.3.6")
NODE_TESTBIN = os.environ.get("TIDAL_NODE_TESTBIN", os.path.join(CACHE, "node-testbin", f"containerd-v{CONTAINERD_VERSION}"))
PAUSE_IMAGE = "tidal.local/pause:1"
BUSYBOX_IMAGE = "tidal.local/busybox:1"
# the hostPath directories of deploy/agent-daemonset.yaml, removed after the tier when it made them
AGENT_HOST_DIRS = ("/var/lib/tidal", "/run/tidal", "/run/nri", "/var/lib/kubelet")
# the kubelet's default root directory: the agent reads the kubelet's cpu_manager_state there
KUBELET_ROOT = "/var/lib/kubelet"
NRI_SOCKET = "/var/run/nri/nri.sock"
LEFTOVER_MARK = ".tidal-node-tier"
# v1 hierarchies the kubelet makes kubepods in (cgroupfs driver), and the unified one
CGROUP_ROOT = "/sys/fs/cgroup"


def node_testbin() -> Optional[str]:
    wanted = ("containerd", "containerd-shim-runc-v2", "ctr", f"runc-{RUNC_VERSION}", "busybox.oci.tar")
    if all(os.path.exists(os.path.join(NODE_TESTBIN, f)) for f in wanted) and pause_archive(NODE_TESTBIN):
        return NODE_TESTBIN
    return None


def restrict_oom() -> bool:
    """Whether this process may not lower its oom_score_adj (no CAP_SYS_RESOURCE)."""
    with open("/proc/self/status") as handle:
        caps = next(int(line.split()[1], 16) for line in handle if line.startswith("CapEff:"))
    return not caps & (1 << 24)


def pause_archive(bin_dir: str) -> Optional[str]:
    for name in sorted(os.listdir(bin_dir)) if os.path.isdir(bin_dir) else ():
        if name.startswith("pause-") and name.endswith(".oci.tar"):
            return os.path.join(bin_dir, name)
    return None


def kubepods_cgroups() -> List[str]:
    found = []
    for hierarchy in sorted(os.listdir(CGROUP_ROOT)):
        for candidate in (os.path.join(CGROUP_ROOT, hierarchy, "kubepods"),
                          os.path.join(CGROUP_ROOT, hierarchy, "kubepods.slice")):
            if os.path.isdir(candidate):
                found.append(candidate)
    for candidate in (os.path.join(CGROUP_ROOT, "kubepods"),):
        if os.path.isdir(candidate):
            found.append(candidate)
    return found


def unmount_under(directory: str) -> None:
    """Lazily unmount every mount point at or under ``directory``, deepest first."""
    with open("/proc/self/mountinfo") as handle:
        points = [line.split()[4] for line in handle]
    for point in sorted((p for p in points if p == directory or p.startswith(directory.rstrip("/") + "/")),
                        key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


class RealNode:
    def __init__(self, k8s_bin: str, node_bin: str, image_archive: str, image_name: str) -> None:
        self.k8s_bin = k8s_bin
        self.node_bin = node_bin
        self.runc = os.path.join(node_bin, f"runc-{RUNC_VERSION}")
        self.image_archive = image_archive
        self.image_name = image_name
        self.name = f"tidal-node-{uuid.uuid4().hex[:6]}"
        self.link = f"tnd{uuid.uuid4().hex[:8]}"
        self.plane: Optional[ControlPlane] = None
        self.dir = ""
        self.made_dirs: List[str] = []

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> "RealNode":
        """The node's system daemons (etcd, the control plane, the kubelet, and this test process that
        drives them) run on the cpus Tidal reserves by default, as a node's system daemons do on its
        reserved cpus (the kubelet's reservedSystemCPUs): on this 2-cpu host they would otherwise be
        most of the "online" load on the one cpu left to pods, and leave no reclaimed capacity.
        containerd is started on every cpu: what it starts inherits its affinity."""
        from agent.qrm.policy import default_reserved
        from agent.topology import HostFS, discover

        self.every_cpu = os.sched_getaffinity(0)
        self.reserved = set(default_reserved(discover(HostFS("/"), use_cpuinfo_lib=False)))
        os.sched_setaffinity(0, self.reserved)
        for path in AGENT_HOST_DIRS:
            if os.path.exists(path) and os.listdir(path):
                raise RuntimeError(f"{path} exists and is not empty: a Tidal agent or a container runtime may "
                                   "run on this host; the node tier runs the DaemonSet and containerd, which use it")
            if not os.path.exists(path):
                self.made_dirs.append(path)
            # the mark by which `make clean-test-leftovers` knows, after a killed run, that the tier used it
            os.makedirs(path, exist_ok=True)
            open(os.path.join(path, LEFTOVER_MARK), "w").close()
        if kubepods_cgroups():
            if subprocess.run(["pgrep", "-x", "kubelet"], capture_output=True).returncode == 0:
                raise RuntimeError(f"a kubelet runs on this host ({kubepods_cgroups()[0]} exists); the node tier "
                                   "runs its own")
            # no kubelet: an earlier run's trees (a killed run); the empty ones go, as `make clean-test-leftovers`
            # removes them, and a tree with tasks in it stops the tier
            held = [path for path in kubepods_cgroups() if not remove_cgroup_tree(path, timeout=0)]
            if held:
                raise RuntimeError(f"kubepods cgroups with tasks in them exist ({held[0]}) and no kubelet runs: "
                                   "run `make clean-test-leftovers`")
        # a veth pair, not a dummy link: this host's kernel has no dummy module; deleting one end removes both
        subprocess.run(["ip", "link", "add", self.link, "type", "veth", "peer", "name", self.link + "p"], check=True,
                       capture_output=True)
        subprocess.run(["ip", "addr", "add", f"{API_ADDRESS}/32", "dev", self.link], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", self.link, "up"], check=True, capture_output=True)
        # aggregator routing: the API server reaches an aggregated API server (tidal cluster metrics) at its
        # Service's endpoints, not its ClusterIP, which nothing routes here (no kube-proxy)
        self.plane = ControlPlane(self.k8s_bin, address=API_ADDRESS, port=443, service_cidr=SERVICE_CIDR,
                                  service_accounts=True, apiserver_flags=("--enable-aggregator-routing=true",))
        self.plane.start()
        self.dir = self.plane.dir
        self.kubeconfig = self.plane.kubeconfig()
        # Deployments scaled by a HorizontalPodAutoscaler, and the Endpoints of Services (the metrics API's)
        self.plane.start_controller_manager(extra=(
            "deployment-controller", "replicaset-controller", "horizontal-pod-autoscaler-controller",
            "endpoints-controller", "endpointslice-controller"))
        self.plane.start_default_scheduler()
        self._containerd()
        self._import(pause_archive(self.node_bin), PAUSE_IMAGE)
        self._import(os.path.join(self.node_bin, "busybox.oci.tar"), BUSYBOX_IMAGE)
        self._import(self.image_archive, self.image_name)
        self._kubelet()
        return self

    def _spawn(self, name: str, argv: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        every = self.every_cpu if name == "containerd" else None
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, env=env,
                                preexec_fn=(lambda: os.sched_setaffinity(0, every)) if every else None)
        log.close()
        self.plane.procs[name] = proc
        return proc

    @property
    def containerd_socket(self) -> str:
        return f"{self.dir}/containerd/containerd.sock"

    def _containerd(self) -> None:
        d = f"{self.dir}/containerd"
        for sub in ("root", "state", "cni/bin", "cni/net.d"):
            os.makedirs(f"{d}/{sub}", exist_ok=True)
        with open(f"{d}/config.toml", "w") as handle:
            handle.write(f"""version = 3
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{d}/containerd.sock"
[ttrpc]
  address = "{d}/containerd.sock.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  # this host withholds CAP_SYS_RESOURCE even from root: no process may lower its oom_score_adj,
  # and the sandbox's -998 (a Guaranteed container's -997) fails runc ("failed to update
  # /proc/self/oom_score_adj: Permission denied"). containerd's own setting for hosts like it
  # clamps a container's score to containerd's (0 here); nothing else changes.
  restrict_oom_score_adj = {"true" if restrict_oom() else "false"}
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "{self.runc}"
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["{d}/cni/bin"]
  conf_dir = "{d}/cni/net.d"
[plugins.'io.containerd.nri.v1.nri']
  # NRI's default socket, where the DaemonSet's plugin looks (deploy/agent-daemonset.yaml)
  disable = false
  socket_path = "{NRI_SOCKET}"
""")
        env = dict(os.environ, PATH=f"{self.node_bin}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}")
        proc = self._spawn("containerd", [f"{self.node_bin}/containerd", "--config", f"{d}/config.toml",
                                          "--log-level", os.environ.get("TIDAL_NODE_CONTAINERD_LOG", "info")], env=env)
        _wait(lambda: os.path.exists(self.containerd_socket) and self.ctr("version").returncode == 0, "containerd",
              timeout=60, proc=proc, log=f"{self.dir}/containerd.log")

    def ctr(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run([f"{self.node_bin}/ctr", "--address", self.containerd_socket, "--namespace", "k8s.io",
                               *args], capture_output=True, text=True, check=check, timeout=300)

    def _import(self, archive: str, name: str) -> None:
        done = self.ctr("images", "import", archive)
        if done.returncode != 0:
            raise RuntimeError(f"ctr images import {archive}: {done.stderr.strip()}")
        listed = self.ctr("images", "list", "--quiet").stdout.split()
        full = name if "/" in name.split(":")[0] and "." in name.split("/")[0] else f"docker.io/library/{name}"
        if full not in listed and name not in listed:
            raise RuntimeError(f"ctr images import {archive}: {name} not among {listed}")

    def _kubelet(self) -> None:
        d = f"{self.dir}/kubelet"
        os.makedirs(KUBELET_ROOT, exist_ok=True)
        os.makedirs(f"{d}/pod-logs", exist_ok=True)
        self.kubelet_healthz = free_port()
        with open(f"{d}/config.yaml", "w") as handle:
            handle.write(f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# this host is cgroup v1 (hybrid); the kubelet of 1.34 still runs on v1 when told so (1.35 refuses)
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
# the node's address: metrics-server (the HPA test's peer) scrapes the kubelet where the Node says it is
address: {API_ADDRESS}
port: {free_port()}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {self.kubelet_healthz}
# a caller's token checked by the API server (TokenReview), as kubeadm sets it up: metrics-server's
authentication: {{anonymous: {{enabled: false}}, webhook: {{enabled: true}}}}
authorization: {{mode: AlwaysAllow}}
containerRuntimeEndpoint: unix://{self.containerd_socket}
podLogsDir: {d}/pod-logs
# the images were imported, not pulled: nothing may collect them (this host's disk is shared)
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%}}
cpuManagerPolicy: none
serializeImagePulls: false
""")
        proc = self._spawn("kubelet", [
            f"{self.k8s_bin}/kubelet", f"--config={d}/config.yaml", f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={KUBELET_ROOT}", f"--hostname-override={self.name}", f"--node-ip={API_ADDRESS}", "--v=1"])
        import urllib.request

        _wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{self.kubelet_healthz}/healthz", timeout=2).status
              == 200, "kubelet", timeout=120, proc=proc, log=f"{self.dir}/kubelet.log")
        _wait(lambda: self.kubectl("get", "node", self.name).returncode == 0, "the kubelet's Node", timeout=60,
              proc=proc, log=f"{self.dir}/kubelet.log")

    # ---- use -----------------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = False, input: Optional[str] = None) -> subprocess.CompletedProcess:
        done = subprocess.run([f"{self.k8s_bin}/kubectl", f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=120, input=input)
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done

    def get(self, *args: str) -> Dict:
        return json.loads(self.kubectl("get", *args, "-o", "json", check=True).stdout)

    def restart(self, name: str) -> None:
        """Stop one of kubelet / containerd / the control plane's processes and start it again as before."""
        proc = self.plane.procs[name]
        argv, env = proc.args, None
        if name == "containerd":
            env = dict(os.environ, PATH=f"{self.node_bin}:{os.environ.get('PATH', '')}")
        terminate(self.plane.procs.pop(name))
        new = self._spawn(name, list(argv), env=env)
        if name == "containerd":
            _wait(lambda: self.ctr("version").returncode == 0, "containerd", timeout=60, proc=new,
                  log=f"{self.dir}/containerd.log")
        elif name == "kubelet":
            import urllib.request

            _wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{self.kubelet_healthz}/healthz",
                                                 timeout=2).status == 200, "kubelet", timeout=120, proc=new,
                  log=f"{self.dir}/kubelet.log")

    def log(self, name: str, lines: int = 40) -> str:
        return _tail(f"{self.dir}/{name}.log", lines)

    # ---- stop ----------------------------------------------------------------------------
    def stop(self) -> None:
        if self.plane is not None and "kubelet" in self.plane.procs:
            # every pod away the way users take them away, so the kubelet unmounts their volumes
            for ns in self._namespaces():
                self.kubectl("delete", "all", "--all", "-n", ns, "--wait=false")
            self.kubectl("delete", "daemonset", "--all", "-A", "--wait=false")
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and self._pods_left():
                time.sleep(1)
        if self.plane is not None:
            for name in ("kubelet",):
                terminate(self.plane.procs.pop(name, None))
            if "containerd" in self.plane.procs:
                # containers the kubelet did not stop: their shims outlive containerd otherwise
                for task in self.ctr("tasks", "list", "--quiet").stdout.split():
                    self.ctr("tasks", "kill", "--signal", "SIGKILL", task)
                time.sleep(1)
                terminate(self.plane.procs.pop("containerd", None))
            subprocess.run(["pkill", "-f", f"containerd-shim-runc-v2 .*{self.dir}"], capture_output=True)
            for name in ("kube-controller-manager",):
                terminate(self.plane.procs.pop(name, None))
            keep = os.environ.get("TIDAL_K8S_KEEP")
            os.environ["TIDAL_K8S_KEEP"] = "1"
            self.plane.stop()
            if keep is None:
                del os.environ["TIDAL_K8S_KEEP"]
            unmount_under(KUBELET_ROOT)
            if self.dir:
                unmount_under(self.dir)
                if not keep:
                    shutil.rmtree(self.dir, ignore_errors=True)
        for path in kubepods_cgroups():
            if not remove_cgroup_tree(path):
                print(f"node tier: {path} still has tasks; `make clean-test-leftovers` removes it", file=sys.stderr)
        for path in AGENT_HOST_DIRS:
            if path in self.made_dirs:
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(os.path.join(path, LEFTOVER_MARK)):
                os.unlink(os.path.join(path, LEFTOVER_MARK))
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        if getattr(self, "every_cpu", None):
            os.sched_setaffinity(0, self.every_cpu)

    def _namespaces(self) -> List[str]:
        done = self.kubectl("get", "ns", "-o", "jsonpath={.items[*].metadata.name}")
        return [ns for ns in done.stdout.split() if ns not in ("kube-system", "kube-public", "kube-node-lease")]

    def _pods_left(self) -> bool:
        done = self.kubectl("get", "pods", "-A", "-o", "name")
        return done.returncode == 0 and bool(done.stdout.strip())

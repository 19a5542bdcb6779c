"""A real control plane on loopback: etcd, kube-apiserver and kube-scheduler from ``make k8s-testbin``.

The Kubernetes test tiers and ``tidal bench scheduler`` run it (a developer's
tool: the binaries come from the Go module proxy, cached by ``make
k8s-testbin``). No kubelet: Node objects are registered by hand (with status),
or kept alive by KWOK; pods are bound by the scheduler under test. Authentication
is one static admin token; serving certificates are the API server's own
self-signed ones; service-account keys are made with openssl. Everything lives
in a temporary directory and dies with ``stop()``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from common.process import terminate

TOKEN = "tidal-e2e-admin-token"
DEFAULT_TESTBIN = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                               "tidal", "k8s-testbin", "v" + os.environ.get("K8S_VERSION", "1.34.4"))


def testbin() -> Optional[str]:
    path = os.environ.get("TIDAL_K8S_TESTBIN", DEFAULT_TESTBIN)
    if all(os.access(os.path.join(path, b), os.X_OK) for b in ("etcd", "kube-apiserver", "kube-scheduler")):
        return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what: str, timeout: float = 60.0, interval: float = 0.2):
    """``check()``'s first truthy answer; an exception counts as "not yet" (the API or agent may be starting)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001 - not ready yet
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def _wait(check, what: str, timeout: float = 60.0, proc: Optional[subprocess.Popen] = None, log: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); log tail:\n{_tail(log)}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s; log tail:\n{_tail(log)}")


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return ""


class ControlPlane:
    """``address``/``port``/``service_cidr``: where the API server listens and the Service range.
    The node tier (tests/node) puts the API server on the first address of the Service range, on
    443, so the ``kubernetes`` Service's ClusterIP is the server itself and pods reach it with the
    in-cluster configuration and no kube-proxy. ``service_accounts``: the ServiceAccount admission
    plugin (pods get their token volume; needs kube-controller-manager to make the default
    accounts), which the tier without a kubelet leaves off. ``apiserver_flags``: more of kube-apiserver's
    flags."""

    def __init__(self, bin_dir: str, address: str = "127.0.0.1", port: Optional[int] = None,
                 service_cidr: str = "10.0.0.0/24", service_accounts: bool = False, json_storage: bool = True,
                 advertise: Optional[str] = None, apiserver_flags: Sequence[str] = ()) -> None:
        self.apiserver_flags = tuple(apiserver_flags)
        self.bin = bin_dir
        self.dir = tempfile.mkdtemp(prefix="tidal-k8s-")
        self.procs: Dict[str, subprocess.Popen] = {}
        self.etcd_port = free_port()
        self.address = address
        # where the cluster reaches the server, when not where it listens (make test-systemd-kubelet: the
        # VM's side of qemu's user network, forwarded to this host's loopback)
        self.advertise = advertise or address
        self.api_port = port or free_port()
        self.service_cidr = service_cidr
        self.service_accounts = service_accounts
        # the tiers keep etcd's values as JSON (readable when a test fails); a benchmark keeps the API
        # server's default, protobuf, which costs it less per write
        self.json_storage = json_storage
        self.url = f"https://{address}:{self.api_port}"

    def _spawn(self, name: str, argv: List[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        self.procs[name] = proc
        return proc

    def start(self) -> "ControlPlane":
        """etcd and the API server, waited for; where either fails, what started is stopped and the
        directory removed before the error goes up (the callers' ``finally`` holds no plane yet)"""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> "ControlPlane":
        d = self.dir
        subprocess.run(["openssl", "genrsa", "-out", f"{d}/sa.key", "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", f"{d}/sa.key", "-pubout", "-out", f"{d}/sa.pub"], check=True,
                       capture_output=True)
        with open(f"{d}/tokens.csv", "w") as handle:
            handle.write(f"{TOKEN},admin,admin,system:masters\n")
        etcd = self._spawn("etcd", [
            f"{self.bin}/etcd", "--data-dir", f"{d}/etcd", "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}", "--listen-peer-urls",
            f"http://127.0.0.1:{free_port()}", "--log-level", "warn"])
        _wait(lambda: socket.create_connection(("127.0.0.1", self.etcd_port), timeout=1).close() or True, "etcd",
              proc=etcd, log=f"{d}/etcd.log")
        self.start_apiserver()
        return self

    def front_proxy_certs(self) -> List[str]:
        """The aggregation layer's front proxy, as kubeadm sets it up: a CA and the API server's client
        certificate (``front-proxy-client``) it presents to aggregated API servers (``tidal cluster
        metrics`` requires it), made once with openssl; the API server's flags for them."""
        d = f"{self.dir}/front-proxy"
        if not os.path.exists(f"{d}/client.crt"):
            os.makedirs(d, exist_ok=True)

            def run(*argv: str) -> None:
                subprocess.run(list(argv), check=True, capture_output=True, cwd=d)

            run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                "/CN=front-proxy-ca", "-keyout", "ca.key", "-out", "ca.crt")
            run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=front-proxy-client", "-keyout",
                "client.key", "-out", "client.csr")
            run("openssl", "x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "2", "-out", "client.crt")
        return [f"--requestheader-client-ca-file={d}/ca.crt", "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-", f"--proxy-client-cert-file={d}/client.crt",
                f"--proxy-client-key-file={d}/client.key"]

    def start_apiserver(self) -> None:
        d = self.dir
        front_proxy = self.front_proxy_certs()
        api = self._spawn("kube-apiserver", [
            f"{self.bin}/kube-apiserver", f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--secure-port={self.api_port}", f"--bind-address={self.address}", f"--advertise-address={self.advertise}",
            f"--cert-dir={d}/certs", f"--token-auth-file={d}/tokens.csv", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc", f"--service-account-key-file={d}/sa.pub",
            f"--service-account-signing-key-file={d}/sa.key", f"--service-cluster-ip-range={self.service_cidr}",
            "--disable-admission-plugins=" + ("TaintNodesByCondition" if self.service_accounts
                                              else "ServiceAccount,TaintNodesByCondition"), "--enable-priority-and-fairness=false",
            *(["--storage-media-type=application/json"] if self.json_storage else []), *front_proxy, *self.apiserver_flags, "--v=0"])
        import urllib.request
        import ssl

        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE

        def healthy() -> bool:
            request = urllib.request.Request(f"{self.url}/readyz", headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(request, context=context, timeout=2) as response:
                return response.status == 200

        _wait(healthy, "kube-apiserver", timeout=120, proc=api, log=f"{d}/kube-apiserver.log")

    def start_controller_manager(self, extra: Sequence[str] = (), flags: Sequence[str] = ()) -> None:
        """What a DaemonSet and pods need of kube-controller-manager (and ``extra`` controllers, such as
        ``deployment-controller``, with their ``flags``); not the node lifecycle controller, which would taint
        the node NotReady: with no CNI plugin the runtime's network is never ready (every pod of the node tiers
        is hostNetwork)."""
        d = self.dir
        proc = self._spawn("kube-controller-manager", [
            f"{self.bin}/kube-controller-manager", f"--kubeconfig={self.kubeconfig()}",
            "--controllers=daemonset-controller,serviceaccount-controller,serviceaccount-token-controller,"
            "root-ca-certificate-publisher-controller,garbage-collector-controller,pod-garbage-collector-controller,"
            "namespace-controller" + "".join(f",{c}" for c in extra),
            f"--root-ca-file={d}/certs/apiserver.crt", f"--service-account-private-key-file={d}/sa.key",
            "--leader-elect=false", f"--secure-port={free_port()}", "--bind-address=127.0.0.1", "--v=1", *flags])
        _wait(lambda: "Started controller" in _tail(f"{d}/kube-controller-manager.log", 400)
              or "Starting controller" in _tail(f"{d}/kube-controller-manager.log", 400),
              "kube-controller-manager", timeout=60, proc=proc, log=f"{d}/kube-controller-manager.log")

    def start_default_scheduler(self) -> None:
        """The default kube-scheduler, as shipped."""
        d = self.dir
        with open(f"{d}/default-scheduler.yaml", "w") as handle:
            handle.write("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
                         f"clientConnection: {{kubeconfig: {self.kubeconfig()}}}\nleaderElection: {{leaderElect: false}}\n")
        proc = self._spawn("kube-scheduler", [f"{self.bin}/kube-scheduler", f"--config={d}/default-scheduler.yaml",
                                              f"--secure-port={free_port()}", "--bind-address=127.0.0.1"])
        _wait(lambda: "Starting Kubernetes Scheduler" in _tail(f"{d}/kube-scheduler.log", 200), "kube-scheduler",
              timeout=60, proc=proc, log=f"{d}/kube-scheduler.log")

    def stop_apiserver(self) -> None:
        terminate(self.procs.pop("kube-apiserver", None))

    def kubeconfig(self, server: Optional[str] = None, path: Optional[str] = None) -> str:
        """The admin's kubeconfig (at ``path``, by default in the plane's directory), for ``server`` where
        the reader reaches the API server elsewhere than at its own address (a VM)."""
        path = path or f"{self.dir}/kubeconfig"
        with open(path, "w") as handle:
            handle.write(f"""apiVersion: v1
kind: Config
clusters: [{{name: e2e, cluster: {{server: "{server or self.url}", insecure-skip-tls-verify: true}}}}]
users: [{{name: admin, user: {{token: {TOKEN}}}}}]
contexts: [{{name: e2e, context: {{cluster: e2e, user: admin}}}}]
current-context: e2e
""")
        return path

    def extender_certs(self) -> Dict[str, str]:
        """A CA, the extender's server certificate (for 127.0.0.1) and kube-scheduler's client
        certificate, made with openssl as deploy/extender.yaml says."""
        d = f"{self.dir}/extender-tls"
        os.makedirs(d, exist_ok=True)

        def run(*argv: str) -> None:
            subprocess.run(list(argv), check=True, capture_output=True, cwd=d)

        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tidal-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
        for name, extra in (("tls", ["-addext", "subjectAltName=IP:127.0.0.1"]), ("client", [])):
            run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr", *extra)
            run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-copy_extensions", "copy")
        return {k: f"{d}/{k.replace('_', '.')}" for k in ("ca_crt", "tls_crt", "tls_key", "client_crt", "client_key")}

    def start_scheduler(self, extender_url: str, config: str = "deploy/scheduler-config.yaml",
                        tls: Optional[Dict[str, str]] = None) -> None:
        """kube-scheduler with the project's own configuration, pointed at this test's extender
        (and, with ``tls``, at this test's certificates in place of the shipped paths)."""
        import yaml

        d = self.dir
        with open(config) as handle:
            doc = yaml.safe_load(handle)
        doc["clientConnection"]["kubeconfig"] = self.kubeconfig()
        doc["leaderElection"]["leaderElect"] = False
        doc["extenders"][0]["urlPrefix"] = extender_url
        if tls is not None:
            doc["extenders"][0]["tlsConfig"] = {"certFile": tls["client_crt"], "keyFile": tls["client_key"],
                                                "caFile": tls["ca_crt"]}
        with open(f"{d}/scheduler.yaml", "w") as handle:
            yaml.safe_dump(doc, handle)
        proc = self._spawn("kube-scheduler", [f"{self.bin}/kube-scheduler", f"--config={d}/scheduler.yaml",
                                              f"--secure-port={free_port()}", "--bind-address=127.0.0.1", f"--v={os.environ.get('TIDAL_K8S_V', '1')}"])
        _wait(lambda: "Attempting to acquire" in _tail(f"{d}/kube-scheduler.log", 200)
              or "Starting Kubernetes Scheduler" in _tail(f"{d}/kube-scheduler.log", 200), "kube-scheduler",
              timeout=60, proc=proc, log=f"{d}/kube-scheduler.log")

    def api_client(self):
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        config.verify_ssl = False
        config.api_key = {"authorization": f"Bearer {TOKEN}"}
        return client.ApiClient(config)

    def stop(self) -> None:
        # what runs beside the plane (a scheduler under test, KWOK) first, then the API server and etcd
        for name in [n for n in self.procs if n not in ("kube-apiserver", "etcd")] + ["kube-apiserver", "etcd"]:
            terminate(self.procs.pop(name, None))
        if not os.environ.get("TIDAL_K8S_KEEP"):
            shutil.rmtree(self.dir, ignore_errors=True)


def install_manifests(api, *manifests: str) -> None:
    """Tidal's CRDs (NodeResourceTopology, TidalPolicy, NodeUsage; waited for until established), then each of
    ``deploy/<manifest>``, as a user applies them."""
    import yaml
    from kubernetes import client, utils

    ext = client.ApiextensionsV1Api(api)
    for path, name in (("deploy/crd-noderesourcetopology.yaml", "noderesourcetopologies.topology.node.k8s.io"),
                       ("deploy/crd-tidalpolicy.yaml", "tidalpolicies.tidal.io"),
                       ("deploy/crd-nodeusage.yaml", "nodeusages.tidal.io")):
        with open(path) as handle:
            utils.create_from_dict(api, yaml.safe_load(handle))
        wait_for(lambda n=name: any(c.type == "Established" and c.status == "True" for c in
                                    ext.read_custom_resource_definition(n).status.conditions or []),
                 f"{name} to be established")
    for manifest in manifests:
        with open(f"deploy/{manifest}") as handle:
            for doc in yaml.safe_load_all(handle):
                if doc:
                    utils.create_from_dict(api, doc)

"""A simulated fleet on a real API server: KWOK nodes with Tidal's reports, for the scheduler tier and bench.

``Fleet(plane, kwok_binary)`` installs the CRDs the scheduler reads
(NodeResourceTopology, PodGroup), creates Nodes from shapes (``shapes``: the
Node's allocatable and the NRT an agent on that machine writes, see
``agent.bench.fleet``), their reports stamped now, and runs KWOK over them:
the nodes turn Ready and pods bound to them Running, as on a cluster with
kubelets.

KWOK is given a node lease of 1,200 s: no node lifecycle controller runs here
(kube-controller-manager is not started), so nothing reads a lease's expiry,
and KWOK renews every lease at a quarter of its duration: the kubelet's 40 s
would be 500 lease writes a second at 5,000 nodes, taken from the API server
the schedulers are measured on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from contracts.nrt import GROUP as NRT_GROUP, PLURAL as NRT_PLURAL, UPDATED, VERSION as NRT_VERSION, rfc3339
from kube.rest import ApiError, Rest

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
LEASE_SECONDS = 1200
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRDS = ("crd-noderesourcetopology.yaml", "crd-podgroup.yaml")


def kwok_binary() -> Optional[str]:
    """The KWOK built by ``make kwok`` (scripts/kwok.sh), or ``$TIDAL_KWOK``."""
    path = os.environ.get("TIDAL_KWOK") or os.path.join(
        os.environ.get("TIDAL_CACHE", os.path.expanduser("~/.cache/tidal")), "kwok",
        os.environ.get("KWOK_VERSION", "v0.7.0"), "kwok")
    return path if os.access(path, os.X_OK) else None


def kwok_testbin(command: str) -> Tuple[Dict[str, str], str]:
    """The control plane's binaries and KWOK's, for ``command`` (its name, for the error); RuntimeError
    naming what to build where either is missing."""
    from kube.localplane import testbin

    binaries, kwok = testbin(), kwok_binary()
    if binaries is None or kwok is None:
        raise RuntimeError(f"{command} needs the control plane and KWOK: make k8s-testbin kwok")
    return binaries, kwok


def node_object(name: str, shape: Dict, labels: Optional[Dict[str, str]] = None,
                taints: Sequence[Dict] = ()) -> Dict:
    meta = {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                     "type": "kwok", "tidal.io/shape": re.sub(r"[^A-Za-z0-9_.-]", "-", shape["name"])[:63].strip("-_."),
                                     **(labels or {})},
            "annotations": {KWOK_ANNOTATION: "fake"}}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": {"taints": list(taints)},
            "status": {"allocatable": shape["allocatable"], "capacity": shape["allocatable"]}}


def report_object(name: str, shape: Dict, now: float) -> Dict:
    nrt = json.loads(json.dumps(shape["nrt"]))
    nrt["metadata"]["name"] = name
    for attribute in nrt["attributes"]:
        if attribute["name"] == UPDATED:
            attribute["value"] = rfc3339(now)
    return nrt


class Fleet:
    def __init__(self, plane, kwok: str, rest: Optional[Rest] = None) -> None:
        self.plane = plane
        self.kwok_path = kwok
        self.rest = rest or Rest.from_config(plane.api_client().configuration)
        self.kwok: Optional[subprocess.Popen] = None
        self.names: List[str] = []

    def install_crds(self) -> None:
        import yaml

        for crd in CRDS:
            with open(os.path.join(REPO, "deploy", "helm", "tidal", "crds", crd)) as handle:
                doc = yaml.safe_load(handle)
            try:
                self.rest.json("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", doc)
            except ApiError as exc:
                if exc.status != 409:
                    raise
        for crd in ("noderesourcetopologies.topology.node.k8s.io", "podgroups.scheduling.x-k8s.io"):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                got = self.rest.json("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
                if any(c.get("type") == "Established" and c.get("status") == "True"
                       for c in (got.get("status") or {}).get("conditions") or []):
                    break
                time.sleep(0.2)

    def namespace(self, name: str) -> None:
        try:
            self.rest.json("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        except ApiError as exc:
            if exc.status != 409:
                raise

    def add_nodes(self, count: int, shapes: Sequence[Dict], prefix: str = "kwok-node-", reports: bool = True,
                  workers: int = 8, progress: Callable[[str], None] = lambda _: None,
                  labels: Optional[Callable[[int], Dict[str, str]]] = None) -> List[str]:
        """``count`` nodes, shapes taken in turn; with ``reports``, each with its NRT."""
        now = time.time()

        def make(i: int) -> str:
            name = f"{prefix}{i:05d}"
            shape = shapes[i % len(shapes)]
            body = node_object(name, shape, labels(i) if labels else None)
            self.rest.json("POST", "/api/v1/nodes", body, ok=(201, 409))
            self.rest.json("PATCH", f"/api/v1/nodes/{name}/status", {"status": body["status"]},
                           content_type="application/strategic-merge-patch+json")
            if reports:
                self.rest.json("POST", f"/apis/{NRT_GROUP}/{NRT_VERSION}/{NRT_PLURAL}",
                               report_object(name, shape, now), ok=(201, 409))
            return name

        started = time.monotonic()
        made: List[str] = []
        with ThreadPoolExecutor(workers) as pool:
            for i, name in enumerate(pool.map(make, range(count)), 1):
                made.append(name)
                if i % 1000 == 0 or i == count:
                    progress(f"{i}/{count} nodes ({time.monotonic() - started:.0f}s)")
        self.names += made
        return made

    def start_kwok(self) -> None:
        self.kwok = self.plane._spawn("kwok", [
            self.kwok_path, f"--kubeconfig={self.plane.kubeconfig()}",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
            f"--node-lease-duration-seconds={LEASE_SECONDS}", "--cidr=10.128.0.1/9"])

    def wait_ready(self, names: Sequence[str], timeout: float = 300.0) -> None:
        """Until KWOK has every node Ready."""
        deadline = time.monotonic() + timeout
        wanted = set(names)
        while time.monotonic() < deadline:
            if self.kwok is not None and self.kwok.poll() is not None:
                raise RuntimeError(f"kwok exited ({self.kwok.returncode}); see {self.plane.dir}/kwok.log")
            ready = set()
            token = ""
            while True:
                page = self.rest.json("GET", "/api/v1/nodes?limit=2000" + (f"&continue={token}" if token else ""))
                for node in page.get("items") or []:
                    if any(c.get("type") == "Ready" and c.get("status") == "True"
                           for c in (node.get("status") or {}).get("conditions") or []):
                        ready.add(node["metadata"]["name"])
                token = (page.get("metadata") or {}).get("continue") or ""
                if not token:
                    break
            if wanted <= ready:
                return
            time.sleep(1.0)
        raise TimeoutError(f"KWOK did not make {len(wanted - ready)} of {len(wanted)} nodes Ready in {timeout:g}s")

    def stop(self) -> None:
        if self.kwok is not None and self.kwok.poll() is None:
            self.kwok.terminate()
            try:
                self.kwok.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kwok.kill()
                self.kwok.wait()

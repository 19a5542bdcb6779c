"""make test-systemd-kubelet, the host's half: the control plane of the Kubernetes tiers (etcd,
kube-apiserver, kube-controller-manager, the default kube-scheduler, built by ``make k8s-testbin`` at the
kubelet's version) on this host, for the kubelet that runs in the systemd VM.

The VM reaches the host through qemu's user network, whose host address scripts/systemd-vm.sh sets to
10.0.2.1 (qemu forwards it to this host's loopback). The API server listens on 127.0.0.1:443 and
advertises 10.0.2.1, the first address of the Service range 10.0.2.0/24: the ``kubernetes`` Service's
ClusterIP is the server itself, so the DaemonSet's in-cluster configuration reaches it with no kube-proxy
(the node tier's arrangement, tests/node/harness.py).

    python -m tests.systemd.kubeplane K8S_BIN OUT

writes OUT/kubeconfig (for the VM: https://10.0.2.1:443) once the plane serves, then runs until SIGTERM;
the plane's logs are copied to OUT/plane/ when it stops.
"""

import os
import shutil
import signal
import sys
import time

from kube.localplane import ControlPlane

VM_HOST = "10.0.2.1"
SERVICE_CIDR = "10.0.2.0/24"


def main(k8s_bin: str, out: str) -> int:
    plane = ControlPlane(k8s_bin, address="127.0.0.1", port=443, service_cidr=SERVICE_CIDR, service_accounts=True,
                         advertise=VM_HOST)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        plane.start()
        plane.start_controller_manager()
        plane.start_default_scheduler()
        tmp = plane.kubeconfig(server=f"https://{VM_HOST}:443", path=os.path.join(out, "kubeconfig.tmp"))
        os.rename(tmp, os.path.join(out, "kubeconfig"))
        print("kubeplane: serving on 127.0.0.1:443 (the VM's https://10.0.2.1)", flush=True)
        while not stopping:
            time.sleep(0.5)
        return 0
    except Exception as exc:  # one line for the tier's log; the plane's logs are kept below
        print(f"kubeplane: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        logs = os.path.join(out, "plane")
        os.makedirs(logs, exist_ok=True)
        for name in os.listdir(plane.dir) if os.path.isdir(plane.dir) else ():
            if name.endswith(".log"):
                shutil.copy(os.path.join(plane.dir, name), logs)
        plane.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

"""The Kubernetes tier's control plane: one per test module (etcd, kube-apiserver; the scheduler on demand)."""

import pytest

from tests.k8s.controlplane import ControlPlane
from tests.k8s.controlplane import testbin as find_testbin


@pytest.fixture(scope="module")
def plane():
    import urllib3

    bin_dir = find_testbin()
    if bin_dir is None:
        pytest.skip("no control plane binaries: run `make k8s-testbin`")
    urllib3.disable_warnings()
    cp = ControlPlane(bin_dir).start()
    yield cp
    cp.stop()


@pytest.fixture(scope="module")
def api(plane):
    return plane.api_client()

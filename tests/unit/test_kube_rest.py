"""The lean Kubernetes client's connection (``kube.rest.connect``): in a pod, from the service account the
kubelet mounts, without the official client; elsewhere, a kubeconfig through the official loader."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kube.rest import Rest, connect


def service_account(tmp_path, token="tok-1"):
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "ca.crt").write_text("")  # read only when a connection is made
    return {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def test_in_a_pod_the_service_account_and_the_service_address_are_the_connection(tmp_path, monkeypatch):
    import ssl

    environ = service_account(tmp_path)
    monkeypatch.setattr(ssl, "create_default_context", lambda cafile=None: ("context for", cafile))
    rest = Rest.in_cluster("tidal-agent", environ, str(tmp_path / "token"), str(tmp_path / "ca.crt"))
    assert (rest.host, rest.port) == ("10.96.0.1", 443)
    assert rest.headers["Authorization"] == "Bearer tok-1" and rest.headers["User-Agent"] == "tidal-agent"
    assert rest.tls == ("context for", str(tmp_path / "ca.crt")) and rest.tls_spec["verify"] is True
    assert rest.token_file == str(tmp_path / "token")  # read again as the kubelet rotates it
    # an IPv6 service address as the kubelet writes it
    six = Rest.in_cluster("t", dict(environ, KUBERNETES_SERVICE_HOST="fd00::1"), str(tmp_path / "token"),
                          str(tmp_path / "ca.crt"))
    assert six.host == "fd00::1"


@pytest.mark.parametrize("environ, token", [({}, "tok"), ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "tok"),
                                            ({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "443"}, None),
                                            ({"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "443"}, "")],
                         ids=["no-service", "no-port", "no-token-file", "empty-token"])
def test_outside_a_pod_there_is_no_in_cluster_connection(tmp_path, environ, token):
    if token is not None:
        (tmp_path / "token").write_text(token)
    assert Rest.in_cluster("t", environ, str(tmp_path / "token"), str(tmp_path / "ca.crt")) is None


def test_a_port_that_is_no_number_is_one_line(tmp_path):
    environ = dict(service_account(tmp_path), KUBERNETES_SERVICE_PORT="https")
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_PORT 'https' is not a port"):
        Rest.in_cluster("t", environ, str(tmp_path / "token"), str(tmp_path / "ca.crt"))


def test_a_kubeconfig_that_is_not_there_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="no Kubernetes API server configured"):
        connect(str(tmp_path / "missing"), "t")


def test_a_kubeconfig_is_read_by_the_official_loader(tmp_path):
    (tmp_path / "config").write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: Config
        clusters: [{name: c, cluster: {server: "https://192.0.2.7:6443", insecure-skip-tls-verify: true}}]
        users: [{name: u, user: {token: abc}}]
        contexts: [{name: x, context: {cluster: c, user: u}}]
        current-context: x
        """))
    rest = connect(str(tmp_path / "config"), "tidal-agent")
    assert (rest.host, rest.port) == ("192.0.2.7", 6443) and rest.headers["Authorization"] == "Bearer abc"
    assert rest.headers["User-Agent"] == "tidal-agent" and rest.tls_spec["verify"] is False


# what each of Tidal's in-pod processes does at start with the lean client (the node agent, the metrics
# server, the scheduler): none of it may import the official client, whose models cost ~30 MiB a process
IN_POD = """
import json, os, sys, threading
import kube.rest as rest_module
rest_module.SA_TOKEN, rest_module.SA_CA = sys.argv[1], sys.argv[2]
os.environ.update(KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT="9")
rest = rest_module.connect(None, "tidal-agent")
import agent.cli, agent.cli.daemon, agent.cli.cluster
from agent.daemon import Agent, AgentConfig
from agent.k8s.node import KubeNodeAgent
from agent.topology.synthetic import Shape, build_topology
from cluster.podmetrics import TidalMetrics, front_proxy
from cluster.scheduler.service import Scheduler
from kube.crd import check_crd
agent = Agent(AgentConfig(state_dir=sys.argv[3], cgroups_in_memory=True, reserved_cpus=()), echo=lambda line: None,
              topology=build_topology(Shape(sockets=1, numa_per_socket=1, cores_per_numa=4)))
agent.start()
node = KubeNodeAgent(agent, rest, "n1")
node.nrt()
try:
    node.check()  # nothing listens on port 9: one line, through the lean client
except Exception as exc:
    said = str(exc)
TidalMetrics(stale_after=60)
agent.shutdown()
print(json.dumps({"official": sorted(m for m in sys.modules if m.split(".")[0] == "kubernetes"), "said": said}))
"""


def test_tidals_in_pod_processes_never_import_the_official_client(tmp_path):
    import ssl

    service_account(tmp_path)
    bundle = ssl.get_default_verify_paths().openssl_cafile  # any CA bundle: nothing is verified here
    done = subprocess.run([sys.executable, "-c", IN_POD, str(tmp_path / "token"), bundle, str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["official"] == [], found["official"][:10]
    assert found["said"].startswith("cannot list NodeResourceTopology objects: "), found["said"]


def test_a_rotated_token_is_read_again_and_an_expiring_one_renewed(tmp_path):
    """The kubelet rotates a pod's projected token in its file (about hourly); a kubeconfig's exec plugin
    gives tokens that expire, renewed by the loader's hook. Either is taken up within a minute."""
    service_account(tmp_path, "first")
    rest = Rest("10.96.0.1", 443, None, {"Authorization": "Bearer first"}, token_file=str(tmp_path / "token"))
    (tmp_path / "token").write_text("second\n")
    rest._refresh_token()
    assert rest.headers["Authorization"] == "Bearer first"  # read at most once a minute
    rest._token_read -= 61
    rest._refresh_token()
    assert rest.headers["Authorization"] == "Bearer second"
    (tmp_path / "token").unlink()  # a file gone for a moment: the token in hand is kept
    rest._token_read -= 61
    rest._refresh_token()
    assert rest.headers["Authorization"] == "Bearer second"

    class Configuration:  # what the kubeconfig loader leaves for an exec plugin's token
        host, ssl_ca_cert, verify_ssl, cert_file, key_file = "https://192.0.2.1:6443", None, True, None, None
        api_key = {"authorization": "Bearer old"}

        def refresh_api_key_hook(self, configuration):
            configuration.api_key = {"authorization": "Bearer renewed"}

    rest = Rest.from_config(Configuration())
    assert rest.headers["Authorization"] == "Bearer old" and rest.token_file is None
    rest._token_read -= 61
    rest._refresh_token()
    assert rest.headers["Authorization"] == "Bearer renewed"

"""Beside a kubelet whose CPU manager is static, the agent refuses to start (agent/k8s/cpumanager.py):
checkpoints in the kubelet's own format (pkg/kubelet/cm/cpumanager/state/checkpoint.go)."""

import json
import subprocess
import sys

import pytest

from agent.k8s.cpumanager import kubelet_cpu_manager_policy, refusal
from agent.topology.synthetic import Shape, write_tree

STATIC = {"policyName": "static", "defaultCpuSet": "0,3-7",
          "entries": {"2f6c1c4e-2c35-4b5e-9a8c-0d2d3c1f7a10": {"app": "1-2"}}, "checksum": 3158254571}
NONE = {"policyName": "none", "defaultCpuSet": "", "checksum": 1353318690}


@pytest.mark.parametrize("text, policy", [(json.dumps(STATIC), "static"), (json.dumps(NONE), "none"), (None, None)],
                         ids=["static", "none", "no-checkpoint"])
def test_the_policy_is_read_from_the_kubelets_checkpoint(tmp_path, text, policy):
    if text is not None:
        (tmp_path / "cpu_manager_state").write_text(text)
    assert kubelet_cpu_manager_policy(str(tmp_path)) == policy
    assert (refusal(policy, str(tmp_path)) is None) == (policy != "static")


@pytest.mark.parametrize("text", ["{", "[]", '{"defaultCpuSet": ""}', '{"policyName": 3}'],
                         ids=["truncated", "a-list", "no-policy", "policy-not-a-string"])
def test_a_checkpoint_that_is_not_the_kubelets_is_a_clear_error(tmp_path, text):
    (tmp_path / "cpu_manager_state").write_text(text)
    with pytest.raises(ValueError, match="cpu_manager_state: not the kubelet's checkpoint"):
        kubelet_cpu_manager_policy(str(tmp_path))


@pytest.mark.parametrize("state, message", [(STATIC, "CPU manager policy is 'static'"),
                                            ("{", "not the kubelet's checkpoint")], ids=["static", "corrupt"])
def test_the_agent_refuses_to_start_beside_a_static_kubelet_with_one_line(tmp_path, state, message):
    root = tmp_path / "sys"
    write_tree(str(root), Shape(sockets=1, numa_per_socket=1, cores_per_numa=2))
    kubelet = tmp_path / "kubelet"
    kubelet.mkdir()
    (kubelet / "cpu_manager_state").write_text(state if isinstance(state, str) else json.dumps(state))
    done = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--root", str(root), "--cgroups-in-memory",
                           "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state"),
                           "--kube-node", "n1", "--kubeconfig", str(tmp_path / "none"),
                           "--kubelet-root-dir", str(kubelet)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "state").exists()  # nothing started, nothing written

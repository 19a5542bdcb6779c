"""Where the agent finds itself: a kubelet pod, a systemd unit (it stays in either), or neither."""
from agent.daemon import kubelet_pod_of_self, systemd_unit_of_self


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_systemd_service_or_scope_where_systemd_is_pid_1(tmp_path):
    pid1 = write(tmp_path, "comm", "systemd\n")
    assert systemd_unit_of_self(write(tmp_path, "a", "0::/system.slice/tidal.service\n"), pid1) == \
        "/system.slice/tidal.service"
    assert systemd_unit_of_self(write(tmp_path, "b", "0::/user.slice/user-0.slice/session-3.scope\n"), pid1) == \
        "/user.slice/user-0.slice/session-3.scope"
    # already in Tidal's tree, the root, or a v1-only host's lines: not a unit's cgroup
    assert systemd_unit_of_self(write(tmp_path, "c", "0::/tidal/system\n"), pid1) is None
    assert systemd_unit_of_self(write(tmp_path, "d", "0::/\n"), pid1) is None
    assert systemd_unit_of_self(write(tmp_path, "e", "4:cpuset:/system.slice/x.service\n"), pid1) is None


def test_no_unit_where_systemd_is_not_pid_1_or_nothing_is_readable(tmp_path):
    line = write(tmp_path, "a", "0::/system.slice/tidal.service\n")
    assert systemd_unit_of_self(line, write(tmp_path, "comm", "tini\n")) is None
    assert systemd_unit_of_self(line, str(tmp_path / "absent")) is None
    assert systemd_unit_of_self(str(tmp_path / "absent"), write(tmp_path, "comm2", "systemd\n")) is None


def test_a_kubelet_pod(tmp_path):
    pod = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/cri-containerd-ab.scope"
    assert kubelet_pod_of_self(write(tmp_path, "a", f"0::{pod}\n")) == pod
    assert kubelet_pod_of_self(write(tmp_path, "b", "0::/system.slice/tidal.service\n")) is None

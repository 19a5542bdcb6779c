"""The image's name and tag come from one place, pyproject.toml's version: the manifests in deploy/
name it (and never pull it: it may have been imported, not pushed), and scripts/image.sh tags it."""

import glob
import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def version() -> str:
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]["version"]


def containers():
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "*.yaml"))):
        with open(path) as handle:
            for doc in yaml.safe_load_all(handle):
                spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
                for container in spec.get("containers", []):
                    yield os.path.basename(path), container


@pytest.mark.parametrize("where, container", list(containers()), ids=lambda v: v if isinstance(v, str) else v["name"])
def test_every_manifest_names_the_image_of_this_version_and_never_pulls_it(where, container):
    assert container["image"] == f"tidal:{version()}", where
    assert container.get("imagePullPolicy") == "IfNotPresent", where


def test_the_image_build_tags_the_version_of_pyproject():
    with open(os.path.join(REPO, "scripts", "image.sh")) as handle:
        script = handle.read()
    assert 'name="docker.io/library/tidal:$version"' in script
    assert "pyproject.toml" in script.split('name="docker.io', 1)[0]


def test_there_are_manifests_to_check():
    assert {where for where, _ in containers()} >= {"agent-daemonset.yaml", "extender.yaml"}


def _containers_by_name():
    return {(where, c["name"]): c for where, c in containers()}


def _pods():
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "*.yaml"))):
        with open(path) as handle:
            for doc in yaml.safe_load_all(handle):
                spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec")
                if spec:
                    yield os.path.basename(path), spec


def test_every_container_drops_what_it_does_not_need():
    """Least privilege, as the manifests state it line by line: no container is privileged, each drops
    every capability and adds only its own, runs the runtime's seccomp profile on a read-only root."""
    added = {("agent-daemonset.yaml", "agent"): {"SYS_ADMIN", "NET_ADMIN", "SYS_PTRACE", "SYS_NICE",
                                                           "KILL", "DAC_OVERRIDE"}}
    for (where, name), container in _containers_by_name().items():
        context = container.get("securityContext") or {}
        assert context.get("privileged") in (None, False), (where, name)
        assert context.get("capabilities", {}).get("drop") == ["ALL"], (where, name)
        assert set(context.get("capabilities", {}).get("add") or []) == added.get((where, name), set()), (where, name)
        assert context.get("readOnlyRootFilesystem") is True, (where, name)
        pod = next(spec for w, spec in _pods() if w == where and container in spec["containers"])
        seccomp = context.get("seccompProfile") or (pod.get("securityContext") or {}).get("seccompProfile")
        assert seccomp == {"type": "RuntimeDefault"}, (where, name)
        if not added.get((where, name)):  # Kubernetes refuses it beside SYS_ADMIN; everyone else has it off
            assert context.get("allowPrivilegeEscalation") is False, (where, name)


def test_the_cluster_side_runs_as_nobody_and_the_image_says_so():
    for (where, name), container in _containers_by_name().items():
        if where == "agent-daemonset.yaml":
            continue
        pod = next(spec for w, spec in _pods() if w == where and container in spec["containers"])
        context = {**(pod.get("securityContext") or {}), **(container.get("securityContext") or {})}
        assert context.get("runAsNonRoot") is True and context.get("runAsUser") == 65532, (where, name)
        assert container.get("resources", {}).get("limits", {}).get("memory"), (where, name)
    with open(os.path.join(REPO, "scripts", "image.sh")) as handle:
        assert "--config.user 65532:65532" in handle.read()
    with open(os.path.join(REPO, "Containerfile")) as handle:
        assert "USER 65532:65532" in handle.read()


def test_the_agent_sees_one_file_of_the_kubelets_and_the_plugin_one_directory_of_the_agents():
    pod = next(spec for where, spec in _pods() if where == "agent-daemonset.yaml")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {c["name"]: {m["name"]: m for m in c.get("volumeMounts", [])} for c in pod["containers"]}
    kubelet = [v for v in volumes.values() if "/var/lib/kubelet" in (v.get("hostPath") or {}).get("path", "")]
    assert [v["hostPath"] for v in kubelet] == [{"path": "/var/lib/kubelet/cpu_manager_state", "type": "File"}]
    assert all(m.get("readOnly") for c in mounts.values() for m in c.values() if m["name"] == kubelet[0]["name"])
    plugin = mounts["nri"]
    assert set(plugin) == {"plugin", "nri"} and volumes["plugin"]["hostPath"]["path"] == "/run/tidal/plugin"
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    nri = next(c for c in pod["containers"] if c["name"] == "nri")
    # the agent's settings are its config file, the manifest's ConfigMap mounted read-only at /etc/tidal
    assert agent["command"][agent["command"].index("--config") + 1] == "/etc/tidal/agent.yaml"
    assert mounts["agent"]["config"] == {"name": "config", "mountPath": "/etc/tidal", "readOnly": True}
    with open(os.path.join(REPO, "deploy", "agent-daemonset.yaml")) as handle:
        configmap = next(d for d in yaml.safe_load_all(handle) if d and d["kind"] == "ConfigMap")
    assert volumes["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert yaml.safe_load(configmap["data"]["agent.yaml"])["plugin-socket"] == "/run/tidal/plugin/plugin.sock"
    assert nri["command"][nri["command"].index("--agent-socket") + 1] == "/run/tidal/plugin/plugin.sock"


def test_the_agent_sees_systemds_bus_read_only_and_nothing_else_of_run():
    """systemd's bus directory, read-only (a unix socket's connect needs no write to the mount): the agent asks
    systemd to hold its values of the kubelet's pod slices (isolation.systemd)."""
    pod = next(spec for where, spec in _pods() if where == "agent-daemonset.yaml")
    volumes = {v["name"]: v for v in pod["volumes"]}
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["dbus"] == {"name": "dbus", "mountPath": "/run/dbus", "readOnly": True}
    assert volumes["dbus"]["hostPath"] == {"path": "/run/dbus", "type": "DirectoryOrCreate"}
    run = sorted(m["mountPath"] for m in agent["volumeMounts"] if m["mountPath"].startswith("/run"))
    assert run == ["/run/dbus", "/run/tidal"], run
    nri = next(c for c in pod["containers"] if c["name"] == "nri")
    assert "dbus" not in {m["name"] for m in nri["volumeMounts"]}

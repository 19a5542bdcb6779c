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

"""The tests' control plane: ``kube.localplane`` (``tidal bench scheduler`` runs the same one)."""

from kube.localplane import (  # noqa: F401 - re-exported for the tiers
    DEFAULT_TESTBIN, TOKEN, ControlPlane, _tail, _wait, free_port, install_manifests, testbin, wait_for)

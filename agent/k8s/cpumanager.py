"""The kubelet's CPU manager policy, read from the kubelet's own checkpoint.

The kubelet writes ``<root-dir>/cpu_manager_state`` (JSON: ``policyName``, ``defaultCpuSet``,
``entries`` of pinned containers, ``checksum``) whatever its policy. Under ``static`` it pins every
Guaranteed pod with whole cpus itself and rewrites those containers' cpusets on its own reconcile
loop; a second CPU manager on the node then writes the same cpusets against it, and each undoes the
other (koordinator #1214, #2334). Tidal's decision: it is the node's CPU manager, so it refuses to
start beside a static kubelet with one line that says how to fix it (cpuManagerPolicy: none), rather
than pin half the pods and leave the other half to flip-flop. ``none`` (the kubelet's default) and a
node with no checkpoint (no kubelet yet, or a root dir the agent cannot see) are accepted.
"""

from __future__ import annotations

import json
import os
from typing import Optional

DEFAULT_KUBELET_ROOT = "/var/lib/kubelet"
CHECKPOINT = "cpu_manager_state"


def kubelet_cpu_manager_policy(kubelet_root: str = DEFAULT_KUBELET_ROOT) -> Optional[str]:
    """The policy the kubelet's checkpoint names, None when there is no checkpoint to read; a
    checkpoint that is not the kubelet's JSON raises ValueError with the path."""
    path = os.path.join(kubelet_root, CHECKPOINT)
    try:
        with open(path) as handle:
            text = handle.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not the kubelet's checkpoint ({exc.msg})") from None
    policy = doc.get("policyName") if isinstance(doc, dict) else None
    if not isinstance(policy, str) or not policy:
        raise ValueError(f"{path}: not the kubelet's checkpoint (no policyName)")
    return policy


def refusal(policy: Optional[str], kubelet_root: str = DEFAULT_KUBELET_ROOT) -> Optional[str]:
    """Why the agent will not run beside this kubelet, or None."""
    if policy is None or policy == "none":
        return None
    path = os.path.join(kubelet_root, CHECKPOINT)
    return (f"the kubelet's CPU manager policy is {policy!r} ({path}): it pins Guaranteed whole-cpu pods itself "
            f"and two CPU managers rewrite each other's cpusets; set the kubelet's cpuManagerPolicy to none "
            f"(Tidal is this node's CPU manager), remove {path} and restart the kubelet")

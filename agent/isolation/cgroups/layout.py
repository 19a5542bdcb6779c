"""Where workloads' cgroups live.

Tidal's own tree, for standalone use (``base`` is ``tidal`` unless configured)::

    tidal/system                   system_cores (the reserved pool)
    tidal/dedicated/<name>         dedicated_cores, each on its own cpus
    tidal/shared/<name>            shared_cores, on the shared pool
    tidal/reclaimed/<tier>/<name>  reclaimed_cores; the reclaimed parent carries
                                   the pool's cpuset, cpu.idle, the quota cap and
                                   memory limits, so offline agents that put their
                                   own containers under it are bounded without asking

The kubelet's layouts (for the Kubernetes pod source): cgroupfs driver
``kubepods[/burstable|/besteffort]/pod<uid>/<container id>``; systemd driver
``kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice/<runtime>-<id>.scope``
where the uid's dashes become underscores and the runtime prefix is
``cri-containerd`` (containerd) or ``crio`` (CRI-O).
"""

from __future__ import annotations

import re
from typing import Optional

from agent.qrm.model import Allocation, QoS, Tier

GROUPS = ("system", "dedicated", "shared", "reclaimed")
TIERS = tuple(t.value for t in Tier)


_BASE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def check_base(base: str) -> str:
    """``--cgroup-base``: a relative path of plain names. Empty, ``/...``, ``.`` or ``..`` would make
    Tidal's tree the parent itself (whose other cgroups a revert would remove) or escape it."""
    parts = base.split("/") if isinstance(base, str) else []
    if not base or base.startswith("/") or not all(_BASE_PART.match(p) and p not in (".", "..") for p in parts):
        raise ValueError(f"cgroup base {base!r}: must be a relative path of names ([A-Za-z0-9_.-], not . or ..), "
                         f"e.g. tidal")
    return base


def workload_path(base: str, alloc: Allocation) -> str:
    if alloc.qos is QoS.SYSTEM:
        return f"{base}/system"
    if alloc.qos is QoS.DEDICATED:
        return f"{base}/dedicated/{alloc.name}"
    if alloc.qos is QoS.SHARED:
        return f"{base}/shared/{alloc.name}"
    return f"{base}/reclaimed/{alloc.tier.value}/{alloc.name}"


def kubelet_pod_path(driver: str, qos_class: str, pod_uid: str) -> str:
    """The pod cgroup the kubelet creates (``qos_class``: Guaranteed, Burstable, BestEffort)."""
    qos = qos_class.lower()
    if qos not in ("guaranteed", "burstable", "besteffort"):
        raise ValueError(f"unknown pod QoS class {qos_class!r}")
    if driver == "cgroupfs":
        return "kubepods" + ("" if qos == "guaranteed" else f"/{qos}") + f"/pod{pod_uid}"
    if driver == "systemd":
        uid = pod_uid.replace("-", "_")
        if qos == "guaranteed":
            return f"kubepods.slice/kubepods-pod{uid}.slice"
        return f"kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"
    raise ValueError(f"unknown cgroup driver {driver!r} (cgroupfs or systemd)")


def kubelet_container_path(driver: str, qos_class: str, pod_uid: str, container_id: str,
                           runtime: Optional[str] = "containerd") -> str:
    """A container's cgroup; ``container_id`` may carry its ``containerd://`` prefix."""
    if "://" in container_id:
        scheme, container_id = container_id.split("://", 1)
        runtime = {"containerd": "containerd", "cri-o": "crio", "crio": "crio"}.get(scheme, runtime)
    pod = kubelet_pod_path(driver, qos_class, pod_uid)
    if driver == "cgroupfs":
        return f"{pod}/{container_id}"
    prefix = {"containerd": "cri-containerd", "crio": "crio"}.get(runtime or "", None)
    if prefix is None:
        raise ValueError(f"unknown container runtime {runtime!r} (containerd or crio)")
    return f"{pod}/{prefix}-{container_id}.scope"

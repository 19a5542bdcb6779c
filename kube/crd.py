"""Is a CRD served? One check, at start, for the node agent, the extender and the metrics server."""

from __future__ import annotations

from typing import Callable, Optional

from contracts.nrt import GROUP, PLURAL, VERSION

NRT_MISSING = (f"the NodeResourceTopology CRD ({PLURAL}.{GROUP}/{VERSION}) is not installed: "
               f"kubectl apply -f deploy/crd-noderesourcetopology.yaml")


def check_crd(list_one: Callable[[], object], error=RuntimeError, missing: str = NRT_MISSING,
              what: str = "NodeResourceTopology objects") -> None:
    """Raise ``error`` with one line when listing one object (``list_one``) fails: ``missing`` on a 404 (the
    resource type not served), else the status. Works with either client's error (``kube.rest.ApiError``,
    the official client's ``ApiException``): both carry ``status``."""
    try:
        list_one()
    except Exception as exc:  # noqa: BLE001 - either client's error, or the server unreachable
        status: Optional[int] = getattr(exc, "status", None)
        if status == 404:
            raise error(missing) from None
        if status is not None:
            reason = getattr(exc, "reason", None) or getattr(exc, "message", "") or ""
            raise error(f"cannot list {what}: {status} {' '.join(str(reason).split())[:200]}") from None
        raise error(f"cannot list {what}: {exc}") from None

"""Is the NodeResourceTopology CRD served? One check for the node agent and the extender."""

from __future__ import annotations

from kube import timeouts
from contracts.nrt import GROUP, PLURAL, VERSION


def check_crd(custom_api, error=RuntimeError) -> None:
    """Raise ``error`` with one line when the NodeResourceTopology CRD is not served."""
    from kubernetes.client.exceptions import ApiException

    try:
        custom_api.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1, _request_timeout=timeouts.CALL)
    except ApiException as exc:
        if exc.status == 404:
            raise error(f"the NodeResourceTopology CRD ({PLURAL}.{GROUP}/{VERSION}) is not installed: "
                        f"kubectl apply -f deploy/crd-noderesourcetopology.yaml") from None
        raise error(f"cannot list NodeResourceTopology objects: {exc.status} {exc.reason}") from None

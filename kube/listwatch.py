"""The one list-then-watch loop of Tidal's Kubernetes clients (the node agent's pods, the extender's reports).

1. List; hand every object to ``on_list(objects)`` (the consumer drops what
   the list no longer has: deletions missed while the watch was down).
2. Watch from the list's resourceVersion; hand each event to
   ``on_event(type, object)``. The watch ends after ``timeout_seconds`` (the
   server closes it): go to 1, which is the periodic resync.
3. On any error (the API server went away, a 410 Gone, a timeout): count it,
   wait (0.5 s doubling to 10 s, reset by a successful list) and go to 1. The
   consumer keeps acting on what it knew meanwhile.

Objects are handed over as plain dicts (the API's JSON), whichever client
call produced them. Every call carries a client-side timeout (``timeouts``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional

from kube import timeouts

log = logging.getLogger("tidal.k8s")
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 10.0


def _plain(sanitize: Callable[[Any], Any], obj: Any) -> Dict[str, Any]:
    return obj if isinstance(obj, dict) else sanitize(obj)


def list_watch(list_call: Callable[..., Any], *args: Any, on_list: Callable[[List[Dict[str, Any]]], None],
               on_event: Callable[[str, Dict[str, Any]], None], stop: threading.Event, what: str,
               timeout_seconds: int = 60, sanitize: Optional[Callable[[Any], Any]] = None,
               on_error: Optional[Callable[[Exception], None]] = None, **kwargs: Any) -> None:
    """Run until ``stop`` is set (see the module docstring). ``sanitize``: the API client's
    ``sanitize_for_serialization`` for calls that return model objects."""
    from kubernetes import watch

    sanitize = sanitize or (lambda obj: obj)
    timeout_seconds = max(1, int(timeout_seconds))
    backoff = BACKOFF_FIRST
    while not stop.is_set():
        try:
            listing = _plain(sanitize, list_call(*args, _request_timeout=timeouts.CALL, **kwargs))
            on_list([_plain(sanitize, item) for item in listing.get("items") or []])
            backoff = BACKOFF_FIRST
            version = (listing.get("metadata") or {}).get("resourceVersion")
            stream = watch.Watch()
            for event in stream.stream(list_call, *args, resource_version=version, timeout_seconds=timeout_seconds,
                                       _request_timeout=timeouts.watch(timeout_seconds), **kwargs):
                if stop.is_set():
                    stream.stop()
                    return
                if event.get("type") == "ERROR":  # e.g. 410 Gone: the version is too old; relist
                    raise RuntimeError(f"watch error: {_plain(sanitize, event.get('object'))}")
                on_event(event["type"], _plain(sanitize, event["object"]))
        except Exception as exc:  # noqa: BLE001 - keep acting on the last state; catch up on return
            if on_error is not None:
                on_error(exc)
            log.warning("%s: %s; relisting in %.1fs", what, exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

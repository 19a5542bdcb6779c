"""A lean client of the API server's REST interface for the calls made thousands of times a second.

The official client (``kubernetes``) turns every answer into model objects and
every call into several layers of Python: about a millisecond of cpu per call,
which at a thousand bindings a second is a core of its own. The scheduler and
its benchmark speak to the API server through this instead: one keep-alive
HTTP/1.1 connection per thread (``http.client``), bodies as bytes, answers as
bytes or JSON, watches as a stream of JSON lines. What it connects with (the
server, the CA, the token or client certificate) comes from the official
client's ``Configuration``, so a kubeconfig or the in-cluster service account
work as everywhere else in Tidal.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from typing import Any, Dict, Iterator, Optional, Tuple
from urllib.parse import urlsplit

from kube import timeouts


class ApiError(Exception):
    """An answer that is not 2xx: ``status`` and the server's message."""

    def __init__(self, status: int, method: str, path: str, body: bytes) -> None:
        self.status = status
        try:
            message = json.loads(body).get("message", "")
        except (ValueError, AttributeError):
            message = body[:200].decode("utf-8", "replace")
        super().__init__(f"{method} {path}: {status} {message}")
        self.message = message


class Rest:
    """``Rest.from_config(configuration)``; ``call(method, path, body)`` -> (status, bytes)."""

    def __init__(self, host: str, port: int, tls: Optional[ssl.SSLContext], headers: Dict[str, str],
                 timeout: float = timeouts.READ_SECONDS) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.headers = dict(headers)
        self.timeout = timeout
        self._local = threading.local()

    @classmethod
    def from_config(cls, configuration) -> "Rest":
        """From a ``kubernetes.client.Configuration`` (kubeconfig or in-cluster, already loaded)."""
        url = urlsplit(configuration.host)
        tls = None
        if url.scheme == "https":
            tls = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
            if not configuration.verify_ssl:
                tls.check_hostname = False
                tls.verify_mode = ssl.CERT_NONE
            if configuration.cert_file:
                tls.load_cert_chain(configuration.cert_file, configuration.key_file)
        headers = {"Accept": "application/json", "Content-Type": "application/json",
                   "User-Agent": "tidal-scheduler"}
        token = (configuration.api_key or {}).get("authorization") or (configuration.api_key or {}).get("BearerToken")
        if token:
            prefix = (configuration.api_key_prefix or {}).get("authorization", "")
            headers["Authorization"] = token if token.startswith("Bearer ") or not prefix else f"{prefix} {token}"
            if not headers["Authorization"].startswith("Bearer "):
                headers["Authorization"] = "Bearer " + headers["Authorization"]
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(url.hostname or "127.0.0.1", port, tls, headers)

    def _connection(self, timeout: Optional[float] = None) -> http.client.HTTPConnection:
        if self.tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, context=self.tls,
                                               timeout=timeout or self.timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def call(self, method: str, path: str, body: Optional[bytes] = None,
             content_type: Optional[str] = None) -> Tuple[int, bytes]:
        """One request on this thread's keep-alive connection (opened again once if the server closed it)."""
        headers = self.headers if content_type is None else {**self.headers, "Content-Type": content_type}
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._connection()
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                if response.getheader("Connection", "").lower() == "close":
                    conn.close()
                    self._local.conn = None
                return response.status, data
            except (http.client.HTTPException, ConnectionError, ssl.SSLError, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def json(self, method: str, path: str, body: Any = None, ok=(200, 201),
             content_type: Optional[str] = None) -> Any:
        """A call whose answer is JSON; a status outside ``ok`` raises ``ApiError``."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        status, answer = self.call(method, path, data, content_type)
        if status not in ok:
            raise ApiError(status, method, path, answer)
        return json.loads(answer) if answer else None

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60) -> Iterator[Dict[str, Any]]:
        """The events of a watch from ``resource_version`` (each ``{"type", "object"}``), on a
        connection of its own, until the server ends it (``timeout_seconds``)."""
        sep = "&" if "?" in path else "?"
        query = (f"{path}{sep}watch=1&allowWatchBookmarks=true&resourceVersion={resource_version}"
                 f"&timeoutSeconds={int(timeout_seconds)}")
        conn = self._connection(timeout=timeouts.watch(timeout_seconds)[1])
        try:
            conn.request("GET", query, headers=self.headers)
            response = conn.getresponse()
            if response.status != 200:
                raise ApiError(response.status, "GET", query, response.read())
            while True:
                line = response.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def list_watch_raw(rest: Rest, path: str, on_list, on_event, stop: threading.Event, what: str,
                   timeout_seconds: int = 60, page: int = 5000, on_error=None) -> None:
    """kube.listwatch's loop over raw JSON: list (in pages of ``page`` objects), watch from the list's
    version, and when the server ends the watch on time, watch again from the last version seen
    (bookmarks included); on any error (410 Gone, the server away) relist, with backoff 0.5 s
    doubling to 10 s. A cluster of 10,000 pods is not listed again every minute."""
    import logging

    log = logging.getLogger("tidal.k8s")
    backoff = 0.5
    missing = False
    while not stop.is_set():
        try:
            items, version, token = [], "", ""
            while True:
                sep = "&" if "?" in path else "?"
                listing = rest.json("GET", f"{path}{sep}limit={page}" + (f"&continue={token}" if token else ""))
                items.extend(listing.get("items") or [])
                meta = listing.get("metadata") or {}
                version, token = meta.get("resourceVersion", ""), meta.get("continue", "")
                if not token:
                    break
            on_list(items)
            backoff = 0.5
            while not stop.is_set():  # a watch the server ended on time goes on from the last version
                for event in rest.watch(path, version, timeout_seconds):
                    if stop.is_set():
                        return
                    kind = event.get("type")
                    obj = event.get("object") or {}
                    if kind == "ERROR":  # e.g. 410 Gone: the version is too old; relist
                        raise RuntimeError(f"watch error: {obj.get('message') or obj}")
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if kind != "BOOKMARK":
                        on_event(kind, obj)
        except Exception as exc:  # noqa: BLE001 - keep acting on what was known; relist
            if on_error is not None:
                on_error(exc)
            if stop.is_set():
                return
            if isinstance(exc, ApiError) and exc.status == 404:  # a CRD not installed: said once
                if not missing:
                    log.info("%s: not served (its CRD is not installed?); looking again every %.0fs", what, 10.0)
                missing = True
                stop.wait(10.0)
                continue
            log.warning("%s: %s; relisting in %.1fs", what, exc, backoff)
            stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)


def rfc3339_micro(epoch: Optional[float] = None) -> str:
    """A MicroTime as the API server writes it (Lease times, events.k8s.io eventTime)."""
    epoch = time.time() if epoch is None else epoch
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1e6):06d}Z"

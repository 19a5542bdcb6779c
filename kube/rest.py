"""A lean client of the API server's REST interface for the calls made thousands of times a second.

The official client (``kubernetes``) turns every answer into model objects and
every call into several layers of Python: about a millisecond of cpu per call,
which at a thousand bindings a second is a core of its own. The scheduler and
its benchmark speak to the API server through this instead: one keep-alive
HTTP/1.1 connection per thread (``http.client``), bodies as bytes, answers as
bytes or JSON, watches as a stream of JSON lines. What it connects with (the
server, the CA, the token or client certificate) comes from a kubeconfig through the official
client's loader, or, in a pod, from the service account the kubelet mounts (``connect``). The
node agent, ``tidal cluster metrics`` and the scheduler run in pods through this alone: importing
the official client costs a process about 30 MiB of memory (its thousand model classes) and the
agent's calls need none of them.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import threading
import time
from typing import Any, Dict, Iterator, Optional, Tuple
from urllib.parse import urlsplit

from kube import timeouts

try:  # a watch of every pod decodes a few JSON objects per pod bound: the scheduler's largest cost in C
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - a dependency; json does the same, slower
    _loads = json.loads


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


SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
SA_TOKEN = f"{SA_DIR}/token"
SA_CA = f"{SA_DIR}/ca.crt"


class Rest:
    """``Rest.from_config(configuration)``; ``call(method, path, body)`` -> (status, bytes).

    ``spec()`` is what it connects with as plain data, for another process (``Rest.from_spec``). A
    service-account token (in a pod) is read again from its file every minute: the kubelet rotates it."""

    def __init__(self, host: str, port: int, tls: Optional[dict], headers: Dict[str, str],
                 timeout: float = timeouts.READ_SECONDS, token_file: Optional[str] = None,
                 refresh=None) -> None:
        """``refresh``: the kubeconfig loader's ``(hook, configuration)`` for a token that expires (an exec
        plugin's): called with the token file's rhythm, the new token taken from the configuration."""
        self.host, self.port = host, port
        self.refresh = refresh
        self.tls_spec = tls  # {"cafile", "verify", "certfile", "keyfile"} or None for plain HTTP
        self.tls = _context(tls) if tls is not None else None
        self.headers = dict(headers)
        self.timeout = timeout
        self.token_file = token_file
        self._token_read = time.monotonic()
        self._local = threading.local()

    def spec(self) -> dict:
        return {"host": self.host, "port": self.port, "tls": self.tls_spec, "headers": dict(self.headers),
                "timeout": self.timeout, "token_file": self.token_file}

    @classmethod
    def from_spec(cls, spec: dict) -> "Rest":
        return cls(spec["host"], spec["port"], spec["tls"], spec["headers"], spec["timeout"], spec["token_file"])

    def with_timeout(self, timeout: float) -> "Rest":
        """The same server and credentials, with another read timeout (a long call: a large deletion)."""
        return Rest(self.host, self.port, self.tls_spec, self.headers, timeout, self.token_file, self.refresh)

    @classmethod
    def in_cluster(cls, user_agent: str = "tidal", environ=None, token_file: Optional[str] = None,
                   ca_file: Optional[str] = None) -> Optional["Rest"]:
        """In a pod: the API server's service address from the environment the kubelet sets, its CA and the
        pod's service-account token from the files it mounts (the token read again as it rotates). ``None``
        outside a pod (no such environment or token)."""
        environ = os.environ if environ is None else environ
        token_file, ca_file = token_file or SA_TOKEN, ca_file or SA_CA
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            return None
        try:
            with open(token_file) as handle:
                token = handle.read().strip()
        except OSError:
            return None
        if not token:
            return None
        try:
            number = int(port)
        except ValueError:
            raise ValueError(f"KUBERNETES_SERVICE_PORT {port!r} is not a port") from None
        headers = {"Accept": "application/json", "Content-Type": "application/json", "User-Agent": user_agent,
                   "Authorization": "Bearer " + token}
        return cls(host.strip("[]"), number, {"cafile": ca_file, "verify": True, "certfile": None, "keyfile": None},
                   headers, token_file=token_file)

    @classmethod
    def from_config(cls, configuration, user_agent: str = "tidal-scheduler") -> "Rest":
        """From a ``kubernetes.client.Configuration`` (kubeconfig or in-cluster, already loaded)."""
        url = urlsplit(configuration.host)
        tls = None
        if url.scheme == "https":
            tls = {"cafile": configuration.ssl_ca_cert or None, "verify": bool(configuration.verify_ssl),
                   "certfile": configuration.cert_file or None, "keyfile": configuration.key_file or None}
        headers = {"Accept": "application/json", "Content-Type": "application/json", "User-Agent": user_agent}
        token = _token(configuration)
        token_file = None
        if token:
            # a kubeconfig's token comes as "Bearer <t>", the in-cluster loader's as "bearer <t>"
            bare = token.split(" ", 1)[1] if token[:7].lower() == "bearer " else token
            headers["Authorization"] = "Bearer " + bare
            try:
                with open(SA_TOKEN) as handle:
                    if handle.read().strip() == bare:
                        token_file = SA_TOKEN  # the in-cluster token: follow its rotation
            except OSError:
                pass
        port = url.port or (443 if url.scheme == "https" else 80)
        hook = getattr(configuration, "refresh_api_key_hook", None)
        return cls(url.hostname or "127.0.0.1", port, tls, headers, token_file=token_file,
                   refresh=(hook, configuration) if hook is not None and token else None)

    def _refresh_token(self) -> None:
        if (self.token_file is None and self.refresh is None) or time.monotonic() - self._token_read < 60:
            return
        self._token_read = time.monotonic()
        try:
            if self.token_file is not None:
                with open(self.token_file) as handle:
                    token = handle.read().strip()
            else:  # the kubeconfig loader's hook renews what expires (an exec plugin's token)
                hook, configuration = self.refresh
                hook(configuration)
                token = _token(configuration) or ""
                token = token.split(" ", 1)[1] if token[:7].lower() == "bearer " else token
        except Exception:  # noqa: BLE001 - keep the one we have; the API server will say if it expired
            return
        if token:
            self.headers = {**self.headers, "Authorization": "Bearer " + token}

    def _connection(self, timeout: Optional[float] = None) -> http.client.HTTPConnection:
        if self.tls is not None:
            return http.client.HTTPSConnection(self.host, self.port, context=self.tls,
                                               timeout=timeout or self.timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)

    def call(self, method: str, path: str, body: Optional[bytes] = None,
             content_type: Optional[str] = None) -> Tuple[int, bytes]:
        """One request on this thread's keep-alive connection (opened again once if the server closed it)."""
        self._refresh_token()
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
        return _loads(answer) if answer else None

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60) -> Iterator[Dict[str, Any]]:
        """The events of a watch from ``resource_version`` (each ``{"type", "object"}``), on a
        connection of its own, until the server ends it (``timeout_seconds``)."""
        sep = "&" if "?" in path else "?"
        query = (f"{path}{sep}watch=1&allowWatchBookmarks=true&resourceVersion={resource_version}"
                 f"&timeoutSeconds={int(timeout_seconds)}")
        self._refresh_token()
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
                    yield _loads(line)
        finally:
            conn.close()


def _token(configuration) -> Optional[str]:
    keys = configuration.api_key or {}
    return keys.get("authorization") or keys.get("BearerToken")


def connect(kubeconfig: Optional[str] = None, user_agent: str = "tidal") -> Rest:
    """The API server Tidal talks to: the kubeconfig given; else, in a pod, its service account (without
    importing the official client); else the default kubeconfig (``$KUBECONFIG``, ``~/.kube/config``).
    A kubeconfig is read by the official client's loader (contexts, client certificates, exec plugins).
    Raises ``ValueError`` with one line when none can be configured."""
    if not kubeconfig:
        rest = Rest.in_cluster(user_agent)
        if rest is not None:
            return rest
    from kubernetes import config

    try:
        api = config.new_client_from_config(config_file=kubeconfig or None)
    except Exception as exc:  # noqa: BLE001 - the loader's many failures, as one line
        raise ValueError(f"no Kubernetes API server configured: {exc}") from None
    return Rest.from_config(api.configuration, user_agent)


def _context(tls: dict) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=tls.get("cafile"))
    if not tls.get("verify", True):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if tls.get("certfile"):
        context.load_cert_chain(tls["certfile"], tls.get("keyfile"))
    return context


def list_pages(rest: Rest, path: str, page: int = 5000) -> Tuple[list, str]:
    """Every object of a list (``path`` may carry a selector), in pages of ``page``: (items, the list's
    resourceVersion)."""
    items, version, token = [], "", ""
    while True:
        sep = "&" if "?" in path else "?"
        listing = rest.json("GET", f"{path}{sep}limit={page}" + (f"&continue={token}" if token else ""))
        items.extend(listing.get("items") or [])
        meta = listing.get("metadata") or {}
        version, token = meta.get("resourceVersion", ""), meta.get("continue", "")
        if not token:
            return items, version


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
            items, version = list_pages(rest, path, page)
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

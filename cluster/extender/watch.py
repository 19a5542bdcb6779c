"""Feeding the cache: the NodeResourceTopology objects, listed then watched (relisted on error)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict

from contracts.nrt import GROUP, PLURAL, VERSION
from contracts.nrt import decode as to_report
from kube import timeouts
from kube.crd import check_crd
from kube.listwatch import list_watch
from cluster.placement.model import PlacementError
from cluster.extender.cache import TopologyCache

log = logging.getLogger("tidal.extender")


class NrtWatcher(threading.Thread):
    """Feeds a TopologyCache from NodeResourceTopology objects (list + watch, relist on error)."""

    def __init__(self, cache: TopologyCache, api_client, stop: threading.Event) -> None:
        super().__init__(name="nrt-watch", daemon=True)
        self.cache, self.stop = cache, stop
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.synced = threading.Event()

    def check_crd(self) -> None:
        """Fail at start, with one line, when the CRD is not installed."""
        check_crd(lambda: self.api.list_cluster_custom_object(GROUP, VERSION, PLURAL, limit=1,
                                                              _request_timeout=timeouts.CALL), PlacementError)

    def _ingest(self, obj: Dict[str, Any]) -> None:
        try:
            self.cache.put(to_report(obj))
        except PlacementError as exc:
            log.warning("ignoring a report: %s", exc)

    def run(self) -> None:
        list_watch(self.api.list_cluster_custom_object, GROUP, VERSION, PLURAL, on_list=self._on_list,
                   on_event=self._on_event, stop=self.stop, what="NRT watch", timeout_seconds=60)

    def _on_list(self, objects) -> None:
        names = set()
        for obj in objects:
            self._ingest(obj)
            names.add((obj.get("metadata") or {}).get("name"))
        for name in [n for n in list(self.cache.reports) if n not in names]:
            self.cache.remove(name)  # deleted while the watch was down
        self.synced.set()

    def _on_event(self, kind: str, obj) -> None:
        if kind == "DELETED":
            self.cache.remove(obj["metadata"]["name"])
        elif kind in ("ADDED", "MODIFIED"):
            self._ingest(obj)

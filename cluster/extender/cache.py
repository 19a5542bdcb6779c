"""The extender's cache: every node's report, a placement view over them, the pods bound but not yet
reported, and the verbs' answers (filter verdicts, scores), kept and reused while nothing they depend on
moved."""

from __future__ import annotations

import gc
import json
import logging
import re
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from contracts.pods import pod_request
from cluster.placement.model import NodeReport, PodSpec
from cluster.placement.placer import Placer
from cluster.placement.view import ClusterView

log = logging.getLogger("tidal.extender")
MAX_EXTENDER_PRIORITY = 10
# node names are DNS subdomains: nothing to escape in JSON. Names are checked joined by "," (no
# escaping either), never by a character that may itself need escaping (a name with a newline in it
# once made the answer invalid JSON)
_PLAIN = re.compile(r"[A-Za-z0-9._,-]+\Z")
# JSON values a body may hold (counted before decoding: each is a Python object of ~60 bytes, so a 31 MiB
# body of small arrays once took 657 MB); 1,000,000 holds ~3,000 whole Node objects, any number of names
MAX_VALUES = 1_000_000
_KEPT = 16  # candidate lists, answers and fits kept per kind (a scheduler cycles through a few pod shapes)
_PLACEHOLDER_VALUE = "\u0000tidal-known-names"  # no scheduler sends a string as NodeNames
_PLACEHOLDER = json.dumps(_PLACEHOLDER_VALUE).encode()


def pod_spec(pod: Dict[str, Any]) -> Optional[PodSpec]:
    """The placement spec of a pod (``None``: nothing for this extender to check)."""
    request = pod_request(pod)
    doc = request.document
    level = doc["qos"]
    if level == "dedicated_cores":
        return PodSpec("dedicated", doc["cpus"] * 1000, request.memory,
                       numa_bound=bool(doc.get("numa_binding") or doc.get("numa_exclusive")))
    if level == "reclaimed_cores":
        return PodSpec("reclaimed", doc["millicpu"], request.memory)
    if level == "shared_cores":
        return PodSpec("shared", doc["millicpu"], request.memory)
    return None


class TopologyCache:
    """Reports by node name, and a placement view over them rebuilt when the node set changes."""

    def __init__(self, stale_after: float = 120.0, policy: str = "pack") -> None:
        self.stale_after = stale_after
        self.policy = policy
        self.lock = threading.Lock()
        self.reports: Dict[str, NodeReport] = {}
        self.view: Optional[ClusterView] = None
        self.placer: Optional[Placer] = None
        self.reserved: Dict[str, List[Tuple[PodSpec, float, str]]] = {}  # bound pods the node has not reported yet
        self._memo: List[_Candidates] = []  # candidate lists seen last, newest first
        self._segments: List[Tuple[bytes, List[str]]] = []  # their JSON bytes, as the scheduler sends them
        self._prepared: Optional[Tuple[PodSpec, List[str], int, float, bytes]] = None
        self._last_passed: Optional[Tuple[PodSpec, _Candidates]] = None  # what the last filter passed
        self._answers: List[_Answer] = []  # recent filter answers, newest first
        self._scored: List[Tuple[_Candidates, bytes, bytes]] = []  # recent prioritize answers
        self.version = 0  # bumped by every change to the view (reports, removals, reservations)
        self._fits: List[Tuple[PodSpec, int, float, np.ndarray, Any]] = []  # copies per node, by pod shape
        self._changes: List[Tuple[int, int]] = []  # (version, view row) of row-level changes, oldest first
        self._changes_floor = 0  # versions at or below this may have changes no longer listed

    def put(self, report: NodeReport) -> None:
        with self.lock:
            self.version += 1
            known = report.name in self.reports
            self.reports[report.name] = report
            # a report that lists the pod has it in its numbers: drop the reservation (and any
            # reservation older than a report can be stale: the pod never reached the node)
            admitted = set((report.attributes.get("tidal.io/pods") or "").split(","))
            now = time.time()
            self.reserved[report.name] = [(s, t, uid) for s, t, uid in self.reserved.get(report.name, [])
                                          if uid not in admitted and now - t < self.stale_after]
            if known and self.view is not None and len(report.zones) <= self.view.zones:
                self.view.update(report)
                self._changed(self.view.node(report.name))
                self._reapply(report.name)
            else:
                self.view = None

    def remove(self, name: str) -> None:
        with self.lock:
            self.version += 1
            if self.reports.pop(name, None) is not None:
                self.view = None

    def _ensure_view(self) -> None:
        if self.view is None and self.reports:
            self.view = ClusterView(self.reports.values())
            self._changes, self._changes_floor = [], self.version
            # the reports are long-lived: keep the cyclic GC from walking them on every collection
            # that the per-call lists of 5,000 names trigger (tail latency)
            gc.freeze()
            self.placer = Placer(self.view, self.policy, sample_percent=100, stale_after=self.stale_after)
            for name in self.reports:
                self._reapply(name)

    def _changed(self, row: int) -> None:
        """Note that ``row`` of the view changed at this version (fits kept from before are
        brought up to date row by row instead of over the whole cluster)."""
        self._changes.append((self.version, row))
        if len(self._changes) > 4 * _KEPT:
            self._changes_floor = self._changes[_KEPT][0]
            del self._changes[:_KEPT + 1]

    def _reapply(self, name: str) -> None:
        for spec, _, _ in self.reserved.get(name, []):
            self._take_on(name, spec)

    def _take_on(self, name: str, spec: PodSpec) -> None:
        i = self.view.node(name)
        fit, zones = self.placer.node_fit(spec, now=time.time(), rows=np.array([i]))
        if fit[0] <= 0:
            return
        self._changed(i)
        if spec.kind == "reclaimed":
            self.view.recl_cpu[i] -= spec.millicpu
            self.view.recl_mem[i] -= spec.memory
        elif spec.numa_bound:
            free = zones[0]  # copies per zone of this node
            fitting = np.flatnonzero(free > 0)
            z = int(fitting[np.argmin(free[fitting])]) if self.policy == "pack" else int(np.argmax(free))
            self.view.cpu[i, z] -= spec.millicpu
            self.view.mem[i, z] -= spec.memory
        else:
            z = int(np.argmax(self.view.cpu[i]))
            self.view.cpu[i, z] -= min(spec.millicpu, int(self.view.cpu[i, z]))

    def reserve(self, name: str, spec: PodSpec, uid: str = "") -> None:
        """Count a pod just bound to ``name`` until the node's report lists it. Not when the report
        listing it came first (the node admitted and reported the pod while the binding was answered):
        it is in the report's numbers already, and a reservation on top would count it twice until the
        node's next changed report — which need not come, leaving a pod that fits the node's other zone
        unschedulable (the e2e tier's second NUMA-bound pod once stayed unbound for its 60 s: the one path
        found that leaves it so)."""
        with self.lock:
            report = self.reports.get(name)
            if uid and report is not None and uid in (report.attributes.get("tidal.io/pods") or "").split(","):
                return
            self.version += 1
            self.reserved.setdefault(name, []).append((spec, time.time(), uid))
            if self.view is not None and name in self.view.index:
                self._take_on(name, spec)

    # ---- the verbs --------------------------------------------------------------------------
    def read_args(self, raw: bytes) -> Tuple[Dict[str, Any], List[str]]:
        """``ExtenderArgs``: the pod and the candidate names. The scheduler sends the same candidate
        list call after call, and then the filter's answer back to prioritize, byte for byte (Go's
        encoder, DNS names): a list seen before is recognised by its bytes and not decoded again
        (decoding 5,000 names costs ~0.3 ms, the comparison ~10 us). Only the top-level list is
        taken this way: the rest is decoded with a placeholder in its place, and any doubt (the
        placeholder not where the list was) falls back to decoding everything."""
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1  # an upper bound, in C
        if values > MAX_VALUES:
            raise ValueError(f"about {values} JSON values; at most {MAX_VALUES} (use nodeCacheCapable: true, "
                             f"which sends node names only)")
        at = raw.find(b'"NodeNames":[')
        if at >= 0:
            end = raw.find(b"]", at)
            segment = raw[at + 12:end + 1]
            with self.lock:
                names = None
                for position, (seen, known) in enumerate(self._segments):
                    if seen == segment:
                        names = known
                        self._segments.insert(0, self._segments.pop(position))
                        break
            if names is not None:
                args = json.loads(raw[:at + 12] + _PLACEHOLDER + raw[end + 1:], object_hook=_node_stub)
                if isinstance(args, dict) and args.get("NodeNames") == _PLACEHOLDER_VALUE:
                    return args, names
        args = json.loads(raw, object_hook=_node_stub)
        if not isinstance(args, dict):
            raise ValueError("ExtenderArgs must be a JSON object")
        names = _names(args)
        if at >= 0 and args.get("NodeNames") is not None and _PLAIN.match(",".join(names) or "x"):
            self._remember_segment(raw[at + 12:raw.find(b"]", at) + 1], names)
        return args, names

    def _remember_segment(self, segment: bytes, names: List[str]) -> None:
        with self.lock:
            if self._segments and self._segments[0][1] is names:
                return
            kept = [(s, n) for s, n in self._segments if n is not names]
            self._segments = [(segment, names)] + kept[:_KEPT - 1]

    def _candidates(self, names: List[str]) -> _Candidates:
        """The view rows of ``names`` (-1: no report), kept for the next calls: the same list comes
        back (by identity through ``read_args``, else compared, ~20x cheaper than 5,000 lookups);
        a rebuilt view invalidates them."""
        for position, known in enumerate(self._memo):
            if known.view is self.view and (known.names is names or known.names == names):
                if position:
                    self._memo.insert(0, self._memo.pop(position))
                return known
        get = self.view.index.get
        made = _Candidates(names, np.array([get(n, -1) for n in names], dtype=np.int64), self.view)
        self._memo = [made] + self._memo[:_KEPT - 1]
        return made

    def _fit(self, spec: PodSpec) -> np.ndarray:
        """Copies of ``spec`` per node, kept per pod shape for the next calls: when only some rows
        changed since (a binding, a node's new report), only those are computed again. A fit is
        kept at most a second, as nodes' reports age out of freshness."""
        now = time.time()
        for position, (known, version, when, fit, view) in enumerate(self._fits):
            if known != spec or view is not self.view or now - when >= 1.0:
                continue
            if version != self.version:
                if version < self._changes_floor:
                    break
                rows = np.array(sorted({row for v, row in self._changes if v > version}), dtype=np.int64)
                fit = fit.copy()
                if rows.size:
                    fit[rows] = self.placer.node_fit(spec, now=when, rows=rows)[0]
                self._fits[position] = (spec, self.version, when, fit, view)
            return fit
        fit, _ = self.placer.node_fit(spec, now=now)
        kept = [f for f in self._fits if f[0] != spec and f[4] is self.view and now - f[2] < 1.0]
        self._fits = [(spec, self.version, now, fit, self.view)] + kept[:_KEPT - 1]
        return fit

    def _verdicts(self, spec: PodSpec, names: List[str]) -> _Answer:
        """The candidates that pass and the names that fail, grouped by reason. The answer is a
        function of the candidate list, the reason text and four yes/no facts per node (passes,
        trusted, reported, fresh): when those are what they were for an earlier call (a binding
        or a new report usually changes no verdict), that call's answer is used again."""
        why = _why(spec)
        with self.lock:
            self._ensure_view()
            if self.view is None:
                asked = _Candidates(names, np.full(len(names), -1, dtype=np.int64), None)
                known = fits = fresh = np.zeros(len(names), dtype=bool)
            else:
                asked = self._candidates(names)
                known = asked.rows >= 0
                rows = np.where(known, asked.rows, 0)
                fits = self._fit(spec)[rows] > 0
                fresh = self.view.fresh(time.time(), self.stale_after)[rows]
            trusted = known & fresh
            ok = trusted & fits if spec.numa_bound else ~trusted | fits  # unknown: only NUMA-bound pods fail
            code = (ok.astype(np.uint8) | trusted.astype(np.uint8) << 1 | known.astype(np.uint8) << 2
                    | fresh.astype(np.uint8) << 3).tobytes()
            answer = next((a for a in self._answers if a.asked is asked and a.why == why
                           and a.numa_bound == spec.numa_bound and a.code == code), None)
            if answer is None:
                array = asked.array
                passed = _Candidates(array[ok].tolist(), asked.rows[ok], asked.view)
                failed = [(why, array[trusted & ~ok].tolist())]
                if spec.numa_bound:
                    failed += [("no topology report", array[~known].tolist()),
                               (f"topology report older than {self.stale_after:g}s", array[known & ~fresh].tolist())]
                answer = _Answer(asked, why, spec.numa_bound, code, passed,
                                 [(reason, group) for reason, group in failed if group])
                if asked.view is not None:
                    self._answers = [answer] + self._answers[:_KEPT - 1]
            if asked.view is not None:  # the scheduler's prioritize call sends exactly these names next
                self._memo = [answer.passed] + [m for m in self._memo if m is not answer.passed][:_KEPT - 1]
            self._last_passed = (spec, answer.passed)
        return answer

    def filter(self, pod: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
        spec = pod_spec(pod)
        if spec is None:
            return {"NodeNames": names, "FailedNodes": {}, "Error": ""}
        answer = self._verdicts(spec, names)
        return {"NodeNames": answer.passed.names,
                "FailedNodes": {n: r for r, group in answer.failed for n in group}, "Error": ""}

    def filter_json(self, pod: Dict[str, Any], names: List[str]) -> bytes:
        """``filter`` rendered straight to JSON (C-level joins; DNS names need no escaping). The
        answer's name list is remembered by its bytes: it is what prioritize receives next."""
        spec = pod_spec(pod)
        if spec is None or not self._plain(names):
            return json.dumps(self.filter(pod, names)).encode()
        answer = self._verdicts(spec, names)
        if answer.body is None:
            parts = []
            for reason, group in answer.failed:
                tail = '":' + json.dumps(reason)
                parts.append('"' + (tail + ',"').join(group) + tail)
            passed = answer.passed.names
            answer.listed = ("[\"" + '","'.join(passed) + "\"]").encode() if passed else b"[]"
            answer.body = (b'{"NodeNames":' + answer.listed + b',"FailedNodes":{' + ",".join(parts).encode()
                           + b'},"Error":""}')
        self._remember_segment(answer.listed, answer.passed.names)
        return answer.body

    def _plain(self, names: List[str]) -> bool:
        """Whether every name goes into JSON as it is (known lists were checked when first seen)."""
        if any(n is names for _, n in self._segments):
            return True
        return bool(_PLAIN.match(",".join(names) or "x"))

    def _scores(self, spec: Optional[PodSpec], names: List[str]) -> np.ndarray:
        with self.lock:
            self._ensure_view()
            if spec is None or self.view is None:
                return np.zeros(len(names), dtype=np.int64)
            asked = self._candidates(names)
            known = asked.rows >= 0
            values = self.placer.scores(spec, np.where(known, asked.rows, 0), fit=self._fit(spec))
            return np.where(known, np.asarray(values) * MAX_EXTENDER_PRIORITY // 100, 0)

    def prioritize(self, pod: Dict[str, Any], names: List[str]) -> List[Dict[str, Any]]:
        """``HostPriorityList``. Hosts scoring 0 are left out: kube-scheduler adds an extender's
        score only to the hosts it lists (``prioritizeNodes``), so a missing host and a 0 are the
        same to it, and the scheduler has that many fewer entries to decode."""
        scores = self._scores(pod_spec(pod), names).tolist()
        return [{"Host": n, "Score": v} for n, v in zip(names, scores) if v]

    def prioritize_json(self, pod: Dict[str, Any], names: List[str]) -> bytes:
        """``prioritize`` rendered straight to JSON, grouped by score (the list's order carries no
        meaning): one C-level join per score value instead of 5,000 objects through json.dumps.
        An answer prepared right after the filter (``prepare_prioritize``) is served as it is when
        it is for the same pod shape and names and nothing has moved since."""
        spec = pod_spec(pod)
        prepared = self._prepared
        if (prepared is not None and spec is not None and prepared[0] == spec
                and (prepared[1] is names or prepared[1] == names)
                and prepared[2] == self.version and time.time() - prepared[3] < 1.0):
            return prepared[4]
        return self._render_scores(spec, names)

    def prepare_prioritize(self, pod: Dict[str, Any]) -> None:
        """Score the names the last filter passed, before the scheduler asks: kube-scheduler decodes
        the filter's answer and runs its own plugins in between, so this work overlaps its own."""
        spec = pod_spec(pod)
        last = self._last_passed
        if spec is None or last is None or last[0] != spec or last[1].view is not self.view:
            return
        passed = last[1]
        version, now = self.version, time.time()
        self._prepared = (spec, passed.names, version, now, self._render_scores(spec, passed.names))

    def _render_scores(self, spec: Optional[PodSpec], names: List[str]) -> bytes:
        """The scores as JSON; the same candidates with the same scores give the bytes made before."""
        scores = self._scores(spec, names)
        if not self._plain(names):
            return json.dumps([{"Host": n, "Score": int(v)} for n, v in zip(names, scores.tolist()) if v]).encode()
        with self.lock:
            asked = self._candidates(names) if self.view is not None else None
        key = scores.tobytes()
        for known, seen, body in self._scored:
            if known is asked and seen == key:
                return body
        array = asked.array if asked is not None else np.array(names, dtype=object)
        parts = []
        for value in np.unique(scores).tolist():
            if value == 0:
                continue
            hosts = array[scores == value].tolist()
            tail = f'","Score":{value}}}'
            parts.append('{"Host":"' + (tail + ',{"Host":"').join(hosts) + tail)
        body = ("[" + ",".join(parts) + "]").encode()
        if asked is not None:
            self._scored = [(asked, key, body)] + self._scored[:_KEPT - 1]
        return body


class _Answer:
    """One filter answer and what it was computed from (see ``TopologyCache._verdicts``)."""

    __slots__ = ("asked", "why", "numa_bound", "code", "passed", "failed", "listed", "body")

    def __init__(self, asked, why: str, numa_bound: bool, code: bytes, passed, failed) -> None:
        self.asked, self.why, self.numa_bound, self.code = asked, why, numa_bound, code
        self.passed, self.failed = passed, failed
        self.listed: Optional[bytes] = None  # the JSON bytes of the passed names
        self.body: Optional[bytes] = None  # the whole answer as JSON


class _Candidates:
    """One candidate list: the names, their rows in ``view`` (-1: no report), as an object array."""

    __slots__ = ("names", "rows", "view", "_array")

    def __init__(self, names: List[str], rows: np.ndarray, view) -> None:
        self.names, self.rows, self.view, self._array = names, rows, view, None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.array(self.names, dtype=object)
        return self._array


def _why(spec: PodSpec) -> str:
    if spec.numa_bound:
        return (f"no NUMA zone with {spec.millicpu // 1000} cpus, {spec.memory >> 20} MiB"
                + (f", {spec.gpus} GPUs" if spec.gpus else "") + " free (Tidal topology)")
    if spec.kind == "reclaimed":
        return "not enough reclaimed capacity, or the node is in a lending transition"
    return "not enough free cpu/memory for online pods, or the node is lent"


def _node_stub(obj: Dict[str, Any]) -> Dict[str, Any]:
    """Decoding whole Node objects (a scheduler without nodeCacheCapable), keep each one's name only, as
    it is decoded: its images, conditions and labels are freed at once, not held until the whole body is
    (a Node is known by what no Pod has: status.nodeInfo, allocatable or capacity)."""
    status = obj.get("status")
    if "metadata" in obj and isinstance(status, dict) and (
            "nodeInfo" in status or "allocatable" in status or "capacity" in status):
        meta = obj["metadata"]
        return {"metadata": {"name": meta.get("name") if isinstance(meta, dict) else None}}
    return obj


def _names(args: Dict[str, Any]) -> List[str]:
    """The candidate names of ``ExtenderArgs`` (``NodeNames``, or the names of ``Nodes``)."""
    try:
        if args.get("NodeNames") is not None:
            if not isinstance(args["NodeNames"], list):
                raise TypeError("not a list")
            names = list(args["NodeNames"])
        else:
            names = [n["metadata"]["name"] for n in (args.get("Nodes") or {}).get("items") or []]
    except (TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"NodeNames/Nodes are not a list of nodes ({exc!r})") from None
    if not all(isinstance(n, str) for n in names):
        raise ValueError("NodeNames must be strings")
    return names

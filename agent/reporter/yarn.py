"""A YARN ResourceManager as a push target: the node-resource REST call, done right.

* **The node** is found in the RM's node list (``GET /ws/v1/cluster/nodes``):
  the live node whose ``nodeHostName`` is this host's name (or ``node_host``),
  unless ``node_id`` names it. A NodeManager's id carries its port, random by
  default, so a restarted NM is a new node, and the RM lists the dead one as
  RUNNING for minutes (until it is LOST): of several, the one whose port a
  process on this host listens on is the live one, else the one registered
  last (the highest ``lastHealthUpdate``). Any failed push drops a found id,
  and the next try looks again; while no NodeManager is registered the RM is
  asked again every ``waiting_retry`` seconds, not after a growing backoff, so
  an NM that registers (at its own configured figure) is corrected at once.
* **The floor**: the RM's ``yarn.scheduler.minimum-allocation-vcores`` and
  ``-mb`` (read from its ``/conf``; YARN's defaults, 1 and 1024, when it
  will not say). A node below them is shut down by the RM the next time its
  NM registers, so Tidal never sends less; what the floor adds beyond Tidal's
  figure is held back by the kernel (the reclaimed tree's cpu quota and memory
  limit), where a container feels it at once.
* **The body** is the RM's ``ResourceOptionInfo``
  (``{"resource": {"memory", "vCores"}, "overCommitTimeout": -1}``); the RM's
  answer is checked: a node whose resource is not what was sent is a failure.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

from agent.reporter.push import Target
from contracts.capacity import YARN_DEFAULT_MINIMUM, YARN_OVERCOMMIT_TIMEOUT, yarn_body, yarn_figures

LIVE_STATES = {"NEW", "RUNNING", "UNHEALTHY", "DECOMMISSIONING"}


class YarnError(RuntimeError):
    pass


def _port(node_id: Any) -> Optional[int]:
    try:
        return int(str(node_id).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def listening_ports(proc: str = "/proc") -> set:
    """TCP ports some process on this host listens on (the kernel's socket tables)."""
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as handle:
                next(handle, None)
                for line in handle:
                    fields = line.split()
                    if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except (OSError, ValueError, IndexError):
            continue
    return ports


class NoNodeManager(YarnError):
    """No live NodeManager of this host is registered (yet): asked again soon, not after a backoff."""


class Unreachable(YarnError):
    """The RM does not answer (restarting): asked again soon too; its NodeManagers register within seconds
    of its start, and their figures should be Tidal's from then on."""


class YarnTarget(Target):
    kind = "yarn"
    waiting_retry = 1.0

    def __init__(self, rm_url: str, node_id: Optional[str] = None, node_host: Optional[str] = None,
                 user: str = "tidal", timeout: float = 10.0) -> None:
        super().__init__(rm_url.rstrip("/"))
        parts = urllib.parse.urlsplit(rm_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--yarn-rm must be an http(s) URL of the ResourceManager's web address, got {rm_url!r}")
        self.rm = rm_url.rstrip("/")
        self.configured_node_id = node_id
        self.node_id = node_id
        self.node_host = node_host
        self.user = user
        self.timeout = timeout
        self.minimum: Optional[Tuple[int, int]] = None
        self.minimum_source = "unknown"
        self.floored = False

    # ---- the RM's REST API ---------------------------------------------------------------------

    def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None) -> Any:
        sep = "&" if "?" in path else "?"
        url = f"{self.rm}{path}{sep}user.name={urllib.parse.quote(self.user)}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method,
                                         headers={"Accept": "application/json", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace").strip()
            raise YarnError(f"{method} {path}: the RM answered {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise Unreachable(f"{method} {path}: cannot reach the RM at {self.rm} ({exc})") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            raise YarnError(f"{method} {path}: the RM's answer is not JSON: {raw[:120]!r}") from None

    def nodes(self) -> List[Dict[str, Any]]:
        doc = self._call("GET", "/ws/v1/cluster/nodes")
        try:
            return list((doc.get("nodes") or {}).get("node") or [])
        except AttributeError:
            raise YarnError(f"GET /ws/v1/cluster/nodes: unexpected answer {str(doc)[:120]}") from None

    def host_names(self) -> List[str]:
        if self.node_host:
            return [self.node_host]
        names = {socket.gethostname(), socket.getfqdn()}
        return sorted(n for n in names if n)

    def discover(self) -> str:
        """The id of this host's live NodeManager in the RM's node list (see the module docstring)."""
        names = set(self.host_names())
        nodes = self.nodes()
        mine = [n for n in nodes if n.get("nodeHostName") in names and n.get("state") in LIVE_STATES]
        if len(mine) > 1:
            ports = listening_ports()
            listened = [n for n in mine if _port(n.get("id")) in ports]
            if listened:
                mine = listened
            mine = sorted(mine, key=lambda n: (n.get("state") == "RUNNING", n.get("lastHealthUpdate") or 0))[-1:]
        if mine:
            return mine[0]["id"]
        seen = ", ".join(f"{n.get('id')} ({n.get('state')})" for n in nodes) or "none"
        raise NoNodeManager(f"no running NodeManager of host {'/'.join(sorted(names))} in the RM's node list "
                            f"(nodes: {seen}); asking again every {self.waiting_retry:g} s")

    def read_minimum(self) -> Tuple[int, int]:
        """The RM's minimum allocation (vcores, MB) from its ``/conf``; YARN's defaults when it will not say."""
        try:
            values = []
            for key, default in (("yarn.scheduler.minimum-allocation-vcores", YARN_DEFAULT_MINIMUM[0]),
                                 ("yarn.scheduler.minimum-allocation-mb", YARN_DEFAULT_MINIMUM[1])):
                doc = self._call("GET", f"/conf?name={key}")
                prop = (doc or {}).get("property") or {}
                values.append(int(prop["value"]) if prop.get("key") == key else default)
            self.minimum_source = "rm"
            return values[0], values[1]
        except (YarnError, ValueError, TypeError, AttributeError, KeyError):
            self.minimum_source = "default"
            return YARN_DEFAULT_MINIMUM

    # ---- the push -------------------------------------------------------------------------------

    def send(self, doc: Dict[str, Any]) -> None:
        if self.minimum is None or self.minimum_source != "rm":
            self.minimum = self.read_minimum()
        if self.node_id is None:
            self.node_id = self.discover()
        vcores, mb, self.floored = yarn_figures(doc, self.minimum)
        path = f"/ws/v1/cluster/nodes/{urllib.parse.quote(self.node_id, safe=':')}/resource"
        try:
            answer = self._call("POST", path, yarn_body(vcores, mb, YARN_OVERCOMMIT_TIMEOUT))
        except YarnError:
            # a dead NM's id answers 503 ("Failed to update the node resource") or 404: whatever the RM said,
            # the next try looks for the live node again (a configured id is kept: it is the operator's word)
            self.node_id = self.configured_node_id
            raise
        got = self._resource_of(answer)
        # the RM applies the update on its dispatcher's thread, after it answered: read the node back until
        # it shows the figures, for as long as a call may take (CI's 2-cpu host once took over the 1 s this
        # waited before, and five such pushes counted as failures though the RM took every one)
        deadline = time.monotonic() + self.timeout
        while got != (vcores, mb) and time.monotonic() < deadline:
            time.sleep(0.2)
            got = self._resource_of(self._call("GET", f"/ws/v1/cluster/nodes/{self.node_id}"))
        if got != (vcores, mb):
            raise YarnError(f"the RM set node {self.node_id} to {got} (vcores, MB), not ({vcores}, {mb}) as sent")
        self.last_sent = {"node_id": self.node_id, "vcores": vcores, "memory_mb": mb, "floored": self.floored,
                          "node_state": doc.get("node_state")}

    def retry_after(self, exc: Exception) -> Optional[float]:
        """How soon to try again after ``exc`` (None: the pusher's backoff)."""
        return self.waiting_retry if isinstance(exc, (NoNodeManager, Unreachable)) else None

    @staticmethod
    def _resource_of(doc: Any) -> Optional[Tuple[int, int]]:
        """(vcores, MB) from the RM's ResourceInfo answer or from a node document's totalResource."""
        if not isinstance(doc, dict):
            return None
        for candidate in (doc, doc.get("resourceInfo"), (doc.get("node") or {}).get("totalResource"),
                          doc.get("totalResource")):
            if isinstance(candidate, dict) and "vCores" in candidate and "memory" in candidate:
                return int(candidate["vCores"]), int(candidate["memory"])
        return None

    def record(self) -> Dict[str, Any]:
        out = super().record()
        out.update({"node_id": self.node_id, "minimum": list(self.minimum) if self.minimum else None,
                    "minimum_source": self.minimum_source, "floored": self.floored})
        return out


# what a NodeManager next to Tidal needs in its yarn-site.xml (`tidal yarn config`), each with why
SITE = (
    ("yarn.nodemanager.resource.cpu-vcores", "{vcores}",
     "what the NodeManager claims when it registers, before Tidal sets its figure: the RM's minimum, never "
     "more than Tidal gives (YARN's default, 8, on any machine, is what a restarted NM held for minutes)"),
    ("yarn.nodemanager.resource.memory-mb", "{mb}", "likewise, in MB"),
    ("yarn.nodemanager.resource.detect-hardware-capabilities", "false",
     "the figures above, not the machine's: Tidal says what of the machine is offline's"),
    ("yarn.nodemanager.container-executor.class",
     "org.apache.hadoop.yarn.server.nodemanager.DefaultContainerExecutor",
     "containers start in the NodeManager's cgroup; Tidal moves each into its reclaimed tree within a period "
     "(LinuxContainerExecutor works too, with YARN's own cgroups handler off: two managers of one cgroup "
     "undo each other)"),
    ("yarn.nodemanager.vmem-check-enabled", "false",
     "memory is bounded by Tidal's reclaimed tree (memory.high/max), which the kernel enforces"),
)


def site_fragment(vcores: int = YARN_DEFAULT_MINIMUM[0], mb: int = YARN_DEFAULT_MINIMUM[1]) -> str:
    """The ``<property>`` elements of ``SITE`` (to paste into yarn-site.xml's ``<configuration>``)."""
    rows = []
    for name, value, why in SITE:
        rows.append(f"  <!-- {why} -->\n  <property><name>{name}</name>"
                    f"<value>{value.format(vcores=vcores, mb=mb)}</value></property>")
    return "\n".join(rows) + "\n"

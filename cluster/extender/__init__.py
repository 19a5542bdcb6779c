"""A kube-scheduler HTTP extender: NUMA-aware filter and score from the nodes' topology reports.

Verbs (JSON over HTTP, the scheduler's ``extender/v1`` types):

* ``POST /filter``: ``ExtenderArgs`` (``nodeCacheCapable``: ``NodeNames``) ->
  ``ExtenderFilterResult``. A NUMA-bound dedicated pod passes only nodes whose
  fresh report has one NUMA zone with its cpu, memory and GPUs; a node with no
  report, or a report older than ``stale_after``, is unknown and fails for
  such pods (it is not trusted) while other pods pass it (the scheduler's own
  fit plugins still check totals). Nodes being lent take no online pods.
* ``POST /prioritize``: ``HostPriorityList`` with scores 0-10 (pack or spread).
* ``POST /bind``: binds the pod (``Binding``) and reserves what it takes in
  the extender's view until that node's report lists the pod (attribute
  ``tidal.io/pods``), so pods scheduled in a burst do not all see the same
  free zone.

Reports come from a watch on NodeResourceTopology objects (list, then watch
from its resourceVersion; relist on 410 Gone or any error, with backoff).

The package: ``cache`` (the reports, the placement view over them, reservations, and the verbs' answers:
filter verdicts and scores, kept and reused), ``watch`` (the NodeResourceTopology list-watch that feeds
the cache), ``server`` (the HTTP server, its limits, TLS, and the binding through the API server).
"""

from cluster.extender.cache import (  # noqa: F401 - the extender's interface
    MAX_EXTENDER_PRIORITY, MAX_VALUES, TopologyCache, pod_spec)
from cluster.extender.server import MAX_BODY, MAX_INFLIGHT, serve, tls_context  # noqa: F401
from cluster.extender.watch import NrtWatcher  # noqa: F401

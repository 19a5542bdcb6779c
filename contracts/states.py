"""Node lending states and the names that carry them between agent and cluster.

``Online -> OnlineToOffline -> Offline -> OfflineToOnline -> Online``
(docs/architecture.md "The model"). The cluster's lending controller sets the
node label; the agent follows it and says where it is in the annotation.
"""

ONLINE, TO_OFFLINE, OFFLINE, TO_ONLINE = "Online", "OnlineToOffline", "Offline", "OfflineToOnline"
STATES = (ONLINE, TO_OFFLINE, OFFLINE, TO_ONLINE)

STATE_LABEL = "tidal.io/node-state"  # what the lending controller wants (Online / Offline)
CURRENT_ANNOTATION = "tidal.io/node-state-current"  # where the agent's state machine is

# extended resources in the node's status: the reclaimed capacity reclaimed pods request
RECLAIMED_CPU = "tidal.io/reclaimed-millicpu"
RECLAIMED_MEMORY = "tidal.io/reclaimed-memory"

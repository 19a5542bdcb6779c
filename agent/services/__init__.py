"""The agent's parts, each one job, all around one state owner (``owner.StateOwner``).

| service       | job                                                                          |
|---------------|------------------------------------------------------------------------------|
| ``owner``     | the state: lock, commit (checkpoint), change notification, pools, a view      |
| ``enforcement`` | the kernel: desired tree -> the one Reconciler; originals, revert          |
| ``admission`` | workloads in and out: admit, place, attach, release; local liveness          |
| ``harvest``   | usage, the reclaim pool's size, the reclaimed capacity, the fast guard       |
| ``eviction``  | reclaimed work over capacity, and the lending notices' ends                  |
| ``lending``   | the node's lending state machine, driven by the API or the cluster          |

``agent.daemon.Agent`` wires them and runs the loop; every service takes the
owner and only what it needs of the others.
"""

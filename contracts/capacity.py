"""The capacity answer in the shapes offline systems take.

The agent's own document (``GET /v1/capacity``) holds ``reclaimed.millicpu``
and ``reclaimed.memory_bytes`` (in ``Offline``: the whole machine less the
reserved pool), and in ``OfflineToOnline`` a ``target`` (0) that the node is
heading to. Offline systems read it as:

* yarn: the body of the ResourceManager's node-resource REST call
  (``POST /ws/v1/cluster/nodes/<id>/resource``):
  ``{"resource": {"memory": MB, "vCores": N}, "overCommitTimeout": -1}``.
  Never below the RM's minimum allocation (1 vcore, 1024 MB unless told): a
  NodeManager whose resource is below it is shut down when it next registers
  (an RM or NM restart). What the floor adds beyond Tidal's figure is held by
  the kernel (the reclaimed tree's quota), not by YARN.
* mesos: revocable scalar resources as a resource estimator reports them,
  ``{"resources": [...]}``; ``mesos-array``: the bare array that Mesos'
  ``Resources::fromJSON`` parses. The Mesos agent adds the revocable resources
  its tasks already hold to what the estimator answers, so these shapes are
  the capacity *less* what revocable tasks hold (``revocable_in_use``).

In ``OfflineToOnline`` every offline shape carries the target (0 here, the
floor for YARN), so offline schedulers stop placing at the start of the notice.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

MIB = 1024 * 1024
FORMATS = ("tidal", "yarn", "mesos", "mesos-array")
YARN_DEFAULT_MINIMUM = (1, 1024)  # yarn.scheduler.minimum-allocation-vcores / -mb
YARN_OVERCOMMIT_TIMEOUT = -1  # the RM never preempts containers over a shrunk node: the kernel throttles them


def offered(doc: Dict[str, Any]) -> Tuple[int, int]:
    """(millicpu, bytes) offline systems may place now: the target during a hand-back, else the capacity."""
    source = doc.get("target") or doc["reclaimed"]
    return int(source["millicpu"]), int(source["memory_bytes"])


def yarn_figures(doc: Dict[str, Any], minimum: Tuple[int, int] = YARN_DEFAULT_MINIMUM) -> Tuple[int, int, bool]:
    """(vcores, memory MB, floored): whole vcores and MB, never below the RM's minimum allocation."""
    millicpu, memory = offered(doc)
    vcores, mb = millicpu // 1000, memory // MIB
    floored = vcores < minimum[0] or mb < minimum[1]
    return max(vcores, minimum[0]), max(mb, minimum[1]), floored


def yarn_body(vcores: int, mb: int, overcommit_timeout: int = YARN_OVERCOMMIT_TIMEOUT) -> Dict[str, Any]:
    """The RM's ``ResourceOptionInfo``, as ``POST /ws/v1/cluster/nodes/<id>/resource`` takes it."""
    return {"resource": {"memory": mb, "vCores": vcores}, "overCommitTimeout": overcommit_timeout}


def mesos_resources(doc: Dict[str, Any], in_use: Tuple[float, float] = (0.0, 0.0)) -> list:
    """Revocable ``cpus`` and ``mem`` (MiB): what is offered less what revocable tasks hold."""
    millicpu, memory = offered(doc)
    cpus = max(0.0, millicpu / 1000.0 - in_use[0])
    mem = max(0.0, float(memory // MIB) - in_use[1])
    return [{"name": "cpus", "type": "SCALAR", "scalar": {"value": round(cpus, 3)}, "revocable": {}},
            {"name": "mem", "type": "SCALAR", "scalar": {"value": float(int(mem))}, "revocable": {}}]


def render_capacity(doc: Dict[str, Any], fmt: str, yarn_minimum: Tuple[int, int] = YARN_DEFAULT_MINIMUM,
                    revocable_in_use: Optional[Tuple[float, float]] = None) -> Any:
    if fmt == "yarn":
        vcores, mb, _ = yarn_figures(doc, yarn_minimum)
        return yarn_body(vcores, mb)
    if fmt in ("mesos", "mesos-array"):
        in_use = revocable_in_use if revocable_in_use is not None else tuple(doc.get("revocable_in_use") or (0, 0))
        resources = mesos_resources(doc, in_use)
        return resources if fmt == "mesos-array" else {"resources": resources}
    return doc

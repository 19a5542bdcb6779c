"""The capacity answer in the shapes offline systems take.

The agent's own document (``GET /v1/capacity``) holds ``reclaimed.millicpu``
and ``reclaimed.memory_bytes``; offline systems read it as:

* yarn: the body of ``yarn rmadmin -updateNodeResource`` / the RM's node
  resource REST call: whole vcores and memory in MB.
* mesos: revocable scalar resources, as a resource estimator reports them.
"""

from __future__ import annotations

from typing import Any, Dict

MIB = 1024 * 1024
FORMATS = ("tidal", "yarn", "mesos")


def render_capacity(doc: Dict[str, Any], fmt: str) -> Any:
    reclaimed = doc["reclaimed"]
    if fmt == "yarn":
        return {"vcores": reclaimed["millicpu"] // 1000, "memory-mb": reclaimed["memory_bytes"] // MIB}
    if fmt == "mesos":
        return {"resources": [
            {"name": "cpus", "type": "SCALAR", "scalar": {"value": reclaimed["millicpu"] / 1000.0}, "revocable": {}},
            {"name": "mem", "type": "SCALAR", "scalar": {"value": float(reclaimed["memory_bytes"] // MIB)},
             "revocable": {}},
        ]}
    return doc

"""GPU details from NVML (``pynvml``, the nvidia-ml-py package) when a driver is present.

NVML is optional: no library, no driver or no permission is the normal case on
most nodes and leaves the sysfs view as it is. NVML names bus ids with an
8-digit domain (``00000000:3B:00.0``); they are matched to sysfs after
normalising.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

from agent.topology.devices import normalize_bdf
from agent.topology.model import Gpu


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def enrich_with_nvml(gpus: Sequence[Gpu], warnings: List[str]) -> List[Gpu]:
    try:
        import pynvml
    except ImportError:
        return list(gpus)
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no NVML here
        return list(gpus)
    by_pci = {g.pci: g for g in gpus}
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            bdf = normalize_bdf(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
            base = by_pci.get(bdf) or Gpu(pci=bdf, vendor="nvidia", numa=None)
            by_pci[bdf] = replace(
                base,
                model=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            )
    except Exception as exc:  # noqa: BLE001
        warnings.append(f"NVML query failed: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return [by_pci[k] for k in sorted(by_pci)]

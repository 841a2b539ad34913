"""Where LoRA adapters are warm, as a Prometheus gauge (CaraServe residency, docs/caraserve.md).

`tidal_worker_adapter_resident_bytes{worker, adapter, level, pinned}`: bytes of the adapter held
at `level` ("device": on the device, ready for the batch; "host": in the worker's host
repository, one copy away). A registered adapter with no series is cold (read from its
directory on use). Set from each `WorkerStats`; series of adapters that left a level go away.
"""
from __future__ import annotations

from prometheus_client import Gauge

from shared.events import WorkerStats
from shared.metrics import REGISTRY

ADAPTER_RESIDENT = Gauge(
    "tidal_worker_adapter_resident_bytes",
    "LoRA adapter bytes held per level (device, host); pinned adapters are never evicted by LRU",
    ["worker", "adapter", "level", "pinned"], registry=REGISTRY,
)

_exported: dict[str, set[tuple[str, str, str, str]]] = {}  # worker -> label sets set last time


def export_residency(stats: WorkerStats) -> None:
    current = set()
    for row in stats.adapter_residency:
        labels = (stats.worker_id, row.adapter, row.level, "true" if row.pinned else "false")
        ADAPTER_RESIDENT.labels(*labels).set(row.bytes)
        current.add(labels)
    for labels in _exported.get(stats.worker_id, set()) - current:
        try:
            ADAPTER_RESIDENT.remove(*labels)
        except KeyError:
            pass
    _exported[stats.worker_id] = current


__all__ = ["ADAPTER_RESIDENT", "export_residency"]

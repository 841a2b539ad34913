"""WarmServe's worker lifecycle in the registry: the planner writes `WorkerRecord.lifecycle`.

Each interval the leader derives every usable worker's role from its stats (`lifecycle_of`:
idle / universal / dedicated / grace) and writes the ones that differ from what the registry holds
(the planner watches the workers bucket), by compare-and-set (`RegistryClient.modify`): a worker's
own writes (its announcer keeps the field) and the registry's liveness writes are never lost, and
a record deleted meanwhile is not recreated. One write per worker at a time; a failed one is tried
again at the next interval. `tidal status` shows the field.
"""
from __future__ import annotations

import msgspec

from shared.events.registry import Bucket, WorkerLifecycle, WorkerRecord
from shared.logging import get_logger
from shared.planner.view import ClusterView
from shared.planner.warmserve_view import lifecycle_label, lifecycle_of
from shared.registry_client import RegistryClient
from shared.wire import TidalError

log = get_logger("tidal.planner.lifecycle")


class LifecycleWriter:
    def __init__(self, registry: RegistryClient) -> None:
        self.registry = registry
        self.recorded: dict[str, WorkerLifecycle | None] = {}  # what the registry holds, from the watch
        self.writing: set[str] = set()

    def on_record(self, worker_id: str, record: object) -> None:
        if isinstance(record, WorkerRecord):
            self.recorded[worker_id] = record.lifecycle
        else:
            self.recorded.pop(worker_id, None)

    def due(self, view: ClusterView) -> dict[str, WorkerLifecycle]:
        """Workers whose derived lifecycle differs from their record (and that have a record); each is
        marked as being written until `write` ends."""
        out: dict[str, WorkerLifecycle] = {}
        for worker in view.usable_workers():
            wid = worker.worker_id
            label = lifecycle_label(lifecycle_of(worker))
            if wid in self.recorded and self.recorded[wid] != label and wid not in self.writing:
                out[wid] = label
        self.writing |= set(out)
        return out

    async def write(self, worker_id: str, label: WorkerLifecycle) -> None:
        def change(current: WorkerRecord | None) -> WorkerRecord | None:
            if current is None or current.lifecycle == label:
                return None
            return msgspec.structs.replace(current, lifecycle=label)

        try:
            await self.registry.modify(Bucket.WORKERS, worker_id, change)
            log.info("worker lifecycle", worker=worker_id, lifecycle=label)
        except (TidalError, OSError) as exc:  # NATS or the registry away: the next interval tries again
            log.warning("worker lifecycle not written", worker=worker_id, lifecycle=label, error=repr(exc))
        finally:
            self.writing.discard(worker_id)


__all__ = ["LifecycleWriter"]

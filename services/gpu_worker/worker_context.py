"""What the worker's control modules need of the worker, handed to them at construction.

adapter_ctl, migration, migration_kv (and, through plain callables, group_ctl and migration_dest)
read the worker's live state — its instances, running requests, requests being migrated away, data
plane — and call back for a few things: run a task beside the mailbox, publish stats now, resume a
request here, stop on an engine failure. They get exactly that, not the worker: no module of theirs
imports worker.py, so the worker is no hub of an import circle.
"""
from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.gpu_worker.admission import Active
    from services.gpu_worker.catalog import CatalogWriter
    from services.gpu_worker.dataplane import WorkerDataPlane
    from services.gpu_worker.instance import ModelInstance
    from services.gpu_worker.migration_dest import KvInbound
    from shared.bus import Bus
    from shared.events import Assignment


class WorkerContext:
    def __init__(self, worker_id: str, instances: "dict[str, ModelInstance]", active: "dict[str, Active]",
                 migrating: set[str], dataplane: "WorkerDataPlane", *, bus: "Callable[[], Bus]",
                 draining: Callable[[], bool], catalog: "Callable[[], CatalogWriter | None]",
                 kv_inbound: "Callable[[], KvInbound]", spawn_task: Callable[[Coroutine[Any, Any, Any]], None],
                 publish_stats: Callable[[], Coroutine[Any, Any, None]],
                 resume_here: "Callable[[Assignment], None]", crashed: Callable[[str, BaseException], None]) -> None:
        self.worker_id = worker_id
        self.instances = instances  # the worker's own dicts and set, live: instances come and go
        self.active = active
        self.migrating = migrating  # requests a MigrateOut is moving away from here
        self.dataplane = dataplane
        self._bus, self._draining, self._catalog, self._kv_inbound = bus, draining, catalog, kv_inbound
        self.spawn_task = spawn_task  # run a coroutine beside the mailbox (cancelled at stop)
        self.publish_stats = publish_stats  # WorkerStats now, not at the next interval
        self.resume_here = resume_here  # run an assignment on this worker again (a failed move)
        self.crashed = crashed  # an engine failed: the worker stops

    @property
    def bus(self) -> "Bus":
        return self._bus()  # the worker's, once it has started

    @property
    def draining(self) -> bool:
        return self._draining()

    @property
    def catalog(self) -> "CatalogWriter | None":
        return self._catalog()  # set when the worker activates its instances

    @property
    def kv_inbound(self) -> "KvInbound":
        return self._kv_inbound()


__all__ = ["WorkerContext"]

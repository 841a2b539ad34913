"""The gateway's cached view of the registry catalog: models, adapters, instances, workers.

Each bucket is watched (change events subscribed first, then listed) and re-listed every
`resync_s`, so a change missed during a NATS reconnect heals by itself. Reads are plain dict
lookups on the request path; nothing on it waits for the registry.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from shared.actors import Actor
from shared.bus import Delivery
from shared.events.registry import (
    AdapterRecord, Bucket, CatalogChanged, CatalogEntry, InstanceRecord, ModelRecord, Record, WorkerRecord,
)
from shared.events.worker import WorkerState
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.subjects import registry_changed
from shared.wire import TidalError

log = get_logger("tidal.gateway.catalog")

WATCHED = (Bucket.MODELS, Bucket.ADAPTERS, Bucket.INSTANCES, Bucket.WORKERS)


@dataclass(frozen=True)
class Stored:
    revision: int
    record: Record
    ts: float


class BucketView:
    """One bucket's records by key, newest revision wins. Pure."""

    def __init__(self) -> None:
        self.entries: dict[str, Stored] = {}

    def apply(self, event: CatalogChanged) -> bool:
        current = self.entries.get(event.key)
        if current is not None and event.revision <= current.revision:
            return False
        if event.op == "delete" or event.record is None:
            self.entries.pop(event.key, None)
        else:
            self.entries[event.key] = Stored(event.revision, event.record, event.ts)
        return True

    def replace(self, listing: Iterable[CatalogEntry]) -> None:
        """A full listing: keys it lacks are gone; a key seen newer in an event keeps that."""
        fresh: dict[str, Stored] = {}
        for entry in listing:
            current = self.entries.get(entry.key)
            if current is not None and current.revision > entry.revision:
                fresh[entry.key] = current
            else:
                fresh[entry.key] = Stored(entry.revision, entry.record, entry.updated_ts)
        self.entries = fresh

    def records(self) -> list[Record]:
        return [s.record for s in self.entries.values()]


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: a base model, and the adapter if it named one."""

    model: ModelRecord
    adapter: AdapterRecord | None = None

    @property
    def name(self) -> str:
        return self.adapter.name if self.adapter is not None else self.model.name


class ModelCatalog(Actor):
    def __init__(self, *, timeout_s: float = 2.0, resync_s: float = 10.0) -> None:
        super().__init__("gateway-catalog")
        self.views = {bucket: BucketView() for bucket in WATCHED}
        self.timeout_s = timeout_s
        self.resync_s = resync_s
        self.loaded = asyncio.Event()  # every watched bucket listed at least once
        self._listed: set[Bucket] = set()

    async def on_start(self) -> None:
        for bucket in WATCHED:
            view = self.views[bucket]

            async def on_change(event: CatalogChanged, _ctx: Delivery, view: BucketView = view) -> None:
                view.apply(event)

            await self.bind(registry_changed(bucket), CatalogChanged, on_change, label="tidal.v1.evt.registry.*")
        self.spawn("resync", self._resync_forever)

    async def _resync_forever(self) -> None:
        client = RegistryClient(self.bus, timeout=self.timeout_s)
        backoff = 0.1
        while True:
            try:
                for bucket in WATCHED:
                    self.views[bucket].replace(await client.list(bucket))
                    self._listed.add(bucket)
            except (TidalError, OSError) as exc:
                log.info("registry not reachable; catalog retry", error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
                continue
            backoff = 0.1
            if len(self._listed) == len(WATCHED) and not self.loaded.is_set():
                self.loaded.set()
                log.info("catalog loaded", models=len(self.views[Bucket.MODELS].entries),
                         adapters=len(self.views[Bucket.ADAPTERS].entries))
            await asyncio.sleep(self.resync_s)

    # --- reads (the request path) -----------------------------------------------------------
    def resolve(self, name: str) -> Target | None:
        model = self.views[Bucket.MODELS].entries.get(name)
        if model is not None:
            return Target(model.record)  # type: ignore[arg-type]
        adapter = self.views[Bucket.ADAPTERS].entries.get(name)
        if adapter is None:
            return None
        record: AdapterRecord = adapter.record  # type: ignore[assignment]
        base = self.views[Bucket.MODELS].entries.get(record.base)
        if base is None:
            return None  # an adapter whose base model is not in the catalog cannot be served
        return Target(base.record, record)  # type: ignore[arg-type]

    def models(self) -> list[tuple[ModelRecord, float]]:
        return [(s.record, s.ts) for s in self.views[Bucket.MODELS].entries.values()]  # type: ignore[misc]

    def adapters(self) -> list[tuple[AdapterRecord, float]]:
        return [(s.record, s.ts) for s in self.views[Bucket.ADAPTERS].entries.values()]  # type: ignore[misc]

    def live_instances(self) -> list[InstanceRecord]:
        """Instances marked ready on a worker that is ready (not starting, draining or dead)."""
        workers = self.views[Bucket.WORKERS].entries
        live: list[InstanceRecord] = []
        for stored in self.views[Bucket.INSTANCES].entries.values():
            inst: InstanceRecord = stored.record  # type: ignore[assignment]
            worker = workers.get(inst.worker_id)
            if inst.state == "ready" and worker is not None:
                record: WorkerRecord = worker.record  # type: ignore[assignment]
                if record.state == WorkerState.READY:
                    live.append(inst)
        return live


__all__ = ["BucketView", "ModelCatalog", "Target"]

"""The registry's request/reply API on `tidal.v1.registry.{get,list,put,delete}` (queue group `registry`).

Reads come straight from the KV buckets; writes are compare-and-set on the key's revision,
so a stale writer gets `RegistryConflict` (key, expected and actual revision) and must read
again. A retried write with the same idempotency key gets the outcome already applied
(`replayed=True`). Handlers run concurrently (bounded): the KV's compare-and-set, not the
mailbox, is what serialises writers — across registry instances too.
"""
from __future__ import annotations

import time

from shared.actors import Actor
from shared.bus import Delivery
from shared.events.registry import (
    CatalogEntry, RegistryConflict, RegistryDelete, RegistryDeleted, RegistryGet, RegistryList, RegistryListing,
    RegistryNotFound, RegistryPut, RegistryWritten, record_bucket, record_key,
)
from shared.logging import get_logger
from shared.subjects import registry_op

from services.registry.idempotency import IdempotencyCache
from services.registry.store import CatalogStore

log = get_logger("tidal.registry.api")

PutOutcome = RegistryWritten | RegistryConflict
DeleteOutcome = RegistryDeleted | RegistryConflict | RegistryNotFound


class RegistryApi(Actor):
    def __init__(self, store: CatalogStore, *, concurrency: int = 32) -> None:
        super().__init__("registry-api", concurrency=concurrency)
        self.store = store
        self.applied: IdempotencyCache[RegistryWritten | RegistryDeleted] = IdempotencyCache()

    async def on_start(self) -> None:
        await self.store.open(self.bus)
        await self.bind(registry_op("get"), RegistryGet, self.get, queue="registry")
        await self.bind(registry_op("list"), RegistryList, self.list, queue="registry")
        await self.bind(registry_op("put"), RegistryPut, self.put, queue="registry")
        await self.bind(registry_op("delete"), RegistryDelete, self.delete, queue="registry")

    async def get(self, msg: RegistryGet, _ctx: Delivery) -> CatalogEntry | RegistryNotFound:
        entry = await self.store.get(msg.bucket, msg.key)
        return entry if entry is not None else RegistryNotFound(bucket=msg.bucket, key=msg.key)

    async def list(self, msg: RegistryList, _ctx: Delivery) -> RegistryListing:
        return await self.store.list(msg)

    async def put(self, msg: RegistryPut, _ctx: Delivery) -> PutOutcome:
        fingerprint = ("put", record_bucket(msg.record), record_key(msg.record), msg.expected_revision, msg.record)
        replay = self.applied.lookup(msg.idempotency_key, fingerprint, time.monotonic())
        if isinstance(replay, RegistryWritten):
            return RegistryWritten(bucket=replay.bucket, key=replay.key, revision=replay.revision, replayed=True)
        outcome = await self.store.put(msg.record, msg.expected_revision)
        if isinstance(outcome, RegistryWritten):
            self.applied.remember(msg.idempotency_key, fingerprint, outcome, time.monotonic())
            return outcome
        # lost the compare-and-set; it may be to our own earlier attempt of this very write
        replay = self.applied.lookup(msg.idempotency_key, fingerprint, time.monotonic())
        if isinstance(replay, RegistryWritten):
            return RegistryWritten(bucket=replay.bucket, key=replay.key, revision=replay.revision, replayed=True)
        log.info("registry write conflict", bucket=str(outcome.bucket), key=outcome.key,
                 expected=outcome.expected_revision, actual=outcome.actual_revision)
        return outcome

    async def delete(self, msg: RegistryDelete, _ctx: Delivery) -> DeleteOutcome:
        fingerprint = ("delete", msg.bucket, msg.key, msg.expected_revision)
        replay = self.applied.lookup(msg.idempotency_key, fingerprint, time.monotonic())
        if isinstance(replay, RegistryDeleted):
            return replay
        outcome = await self.store.delete(msg.bucket, msg.key, msg.expected_revision)
        if isinstance(outcome, RegistryDeleted):
            self.applied.remember(msg.idempotency_key, fingerprint, outcome, time.monotonic())
            return outcome
        replay = self.applied.lookup(msg.idempotency_key, fingerprint, time.monotonic())
        return replay if isinstance(replay, RegistryDeleted) else outcome

"""The durable catalog: one JetStream KV bucket per catalog bucket, compare-and-set writes.

Buckets are `tidal_<bucket>` (see `shared.subjects.kv_bucket`), file storage, on a NATS
server configured with `sync_interval: always`, so an acknowledged write survives a restart
of the registry and of NATS. Every applied write is followed by a `CatalogChanged` event on
`tidal.v1.evt.registry.<bucket>` (watchers apply an event only when its revision is above
the one they hold, so a late or duplicated event is harmless).
"""
from __future__ import annotations

import time
from typing import Any

import nats.errors
import nats.js.errors

from shared.bus import Bus
from shared.events.registry import (
    BUCKET_RECORD, Bucket, CatalogChanged, CatalogEntry, Record, RegistryConflict, RegistryDeleted, RegistryList,
    RegistryListing, RegistryNotFound, RegistryWritten, record_bucket, record_key,
)
from shared.kv import KVBucket
from shared.logging import get_logger
from shared.subjects import kv_bucket, registry_changed
from shared.wire import RevisionConflict

log = get_logger("tidal.registry.store")


class CatalogStore:
    """Typed, compare-and-set access to the catalog buckets, publishing a change per write."""

    def __init__(self, *, history: int = 5, replicas: int = 1) -> None:
        self.history = history
        self.replicas = replicas
        self._bus: Bus | None = None
        self.buckets: dict[Bucket, KVBucket[Any]] = {}

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError("the catalog store is not open")
        return self._bus

    async def open(self, bus: Bus) -> "CatalogStore":
        """Bind every catalog bucket, creating the missing ones (file storage). Idempotent."""
        if self._bus is not None:
            return self
        for bucket in Bucket:
            self.buckets[bucket] = await bus.kv(
                kv_bucket(bucket), BUCKET_RECORD[bucket], history=self.history, replicas=self.replicas,
                storage="file", description=f"Tidal catalog: {bucket}",
            )
        self._bus = bus
        return self

    async def get(self, bucket: Bucket, key: str) -> CatalogEntry | None:
        entry = await self.buckets[bucket].get(key)
        if entry is None:
            return None
        return CatalogEntry(bucket=bucket, key=key, revision=entry.revision, record=entry.value)

    async def list(self, req: RegistryList) -> RegistryListing:
        """One page of a bucket in key order (keys after `req.after` that start with `req.prefix`)."""
        # keys() is a watch: a record rewritten while it runs (a heartbeat) comes again, and the order is the
        # stream's; a page is keys in order, each once
        keys = sorted({k for k in await self.buckets[req.bucket].keys() if k.startswith(req.prefix) and k > req.after})
        entries: list[CatalogEntry] = []
        for key in keys:
            if len(entries) == req.limit:
                return RegistryListing(bucket=req.bucket, entries=entries, more=True)
            entry = await self.get(req.bucket, key)
            if entry is not None:  # deleted between keys() and get()
                entries.append(entry)
        return RegistryListing(bucket=req.bucket, entries=entries, more=False)

    async def put(self, record: Record, expected_revision: int, *, publish: bool = True) -> RegistryWritten | RegistryConflict:
        """Create (`expected_revision` 0) or compare-and-set update; the loser gets RegistryConflict."""
        bucket, key = record_bucket(record), record_key(record)
        kv = self.buckets[bucket]
        try:
            if expected_revision == 0:
                revision = await kv.create(key, record)
            else:
                revision = await kv.update(key, record, expected_revision)
        except RevisionConflict as exc:
            return RegistryConflict(
                bucket=bucket, key=key, expected_revision=expected_revision, actual_revision=exc.actual or 0
            )
        if publish:
            await self.publish(bucket, key, revision, record)
        return RegistryWritten(bucket=bucket, key=key, revision=revision)

    async def delete(self, bucket: Bucket, key: str, expected_revision: int) -> RegistryDeleted | RegistryConflict | RegistryNotFound:
        kv = self.buckets[bucket]
        current = await kv.revision(key)
        if current is None:
            return RegistryNotFound(bucket=bucket, key=key)
        try:
            revision = await self._delete_marker(kv, key, expected_revision)
        except RevisionConflict as exc:
            return RegistryConflict(
                bucket=bucket, key=key, expected_revision=expected_revision, actual_revision=exc.actual or 0
            )
        await self.publish(bucket, key, revision, None)
        return RegistryDeleted(bucket=bucket, key=key, revision=revision)

    async def _delete_marker(self, kv: KVBucket[Any], key: str, expected_revision: int) -> int:
        """Write a compare-and-set delete marker and return its revision (nats-py's KV delete
        drops the publish ack that carries it)."""
        headers = {"KV-Operation": "DEL", "Nats-Expected-Last-Subject-Sequence": str(expected_revision)}
        try:
            ack = await self.bus.js.publish(f"$KV.{kv.name}.{key}", b"", headers=headers)
        except nats.js.errors.APIError as exc:
            if exc.err_code in (10071, 10164):  # wrong last sequence: someone wrote first
                raise RevisionConflict(kv.name, key, expected_revision, await kv.revision(key)) from None
            raise
        return int(ack.seq)

    async def publish(self, bucket: Bucket, key: str, revision: int, record: Record | None) -> None:
        """Announce an applied write (best effort: a lost event is healed by the watcher's re-list)."""
        event = CatalogChanged(
            bucket=bucket, key=key, revision=revision, op="put" if record is not None else "delete", record=record,
            ts=time.time(),
        )
        try:
            await self.bus.publish(registry_changed(bucket), event)
        except nats.errors.Error as exc:
            log.warning("catalog change not published", bucket=str(bucket), key=key, error=repr(exc))

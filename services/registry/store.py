"""The durable catalog: one JetStream KV bucket per catalog bucket, compare-and-set writes.

Buckets are `tidal_<bucket>` (see `shared.subjects.kv_bucket`), file storage, on a NATS
server configured with `sync_interval: always`, so an acknowledged write survives a restart
of the registry and of NATS. Every applied write is followed by a `CatalogChanged` event on
`tidal.v1.evt.registry.<bucket>` (watchers apply an event only when its revision is above
the one they hold, so a late or duplicated event is harmless).
"""
from __future__ import annotations

import json
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
STREAM_KEYS_ATTEMPTS = 5  # pagings of a bucket's keys before giving up on a key set that keeps changing


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
        """One page of a bucket in key order (keys after `req.after` that start with `req.prefix`).

        The keys come from the stream's own per-subject state (one snapshot the server takes when asked),
        not from nats-py's `keys()`: that is a watch, which sees a record rewritten while it runs twice
        or not at all. So every key present before the listing started, and not deleted since, is listed
        exactly once, whatever heartbeats rewrite meanwhile."""
        kv = self.buckets[req.bucket]
        keys = sorted(k for k in await self._stream_keys(kv) if k.startswith(req.prefix) and k > req.after)
        entries: list[CatalogEntry] = []
        for key in keys:
            if len(entries) == req.limit:
                return RegistryListing(bucket=req.bucket, entries=entries, more=True)
            entry = await self.get(req.bucket, key)
            if entry is not None:  # None: only a delete marker is left, or deleted since the snapshot
                entries.append(entry)
        return RegistryListing(bucket=req.bucket, entries=entries, more=False)

    async def _stream_keys(self, kv: KVBucket[Any]) -> set[str]:
        """Every key that has a message in the bucket's stream (live or deleted): JetStream `STREAM.INFO`
        with `subjects_filter`, paged by `offset` (the server sends at most 100,000 subjects a reply). A
        key created between two pages shifts the paging, so a listing whose total changed is taken again."""
        prefix = f"$KV.{kv.name}."
        for _ in range(STREAM_KEYS_ATTEMPTS):
            subjects: set[str] = set()
            total: int | None = None
            while True:
                reply = await self._stream_info(kv, {"subjects_filter": f"{prefix}>", "offset": len(subjects)})
                page = (reply.get("state") or {}).get("subjects") or {}
                subjects.update(page)
                page_total = int(reply.get("total") or len(subjects))
                if total is not None and page_total != total:
                    break  # keys came or went between pages: start again
                total = page_total
                if not page or len(subjects) >= total:
                    return {subject[len(prefix):] for subject in subjects}
        raise RuntimeError(f"{kv.name}: the key set kept changing while it was paged ({STREAM_KEYS_ATTEMPTS} attempts)")

    async def _stream_info(self, kv: KVBucket[Any], request: dict[str, Any]) -> dict[str, Any]:
        # nats-py's stream_info() drops the paging fields (total, offset), so the API is asked directly
        msg = await self.bus.nc.request(
            f"$JS.API.STREAM.INFO.KV_{kv.name}", json.dumps(request).encode(), timeout=self.bus.settings.request_timeout_s,
        )
        reply = json.loads(msg.data)
        if "error" in reply:
            error = reply["error"]
            raise RuntimeError(f"{kv.name}: stream info refused: {error.get('description')} (code {error.get('err_code')})")
        return reply

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

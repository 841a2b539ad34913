"""A typed client of the registry's request/reply API, for every other service and the CLI.

    registry = RegistryClient(bus)
    entry = await registry.get(Bucket.MODELS, "demo-llama")          # CatalogEntry | None
    rev = await registry.put(record, expected_revision=entry.revision) # RevisionConflict if someone wrote first
    rev = await registry.create(record)                                # RevisionConflict if it exists
    entry = await registry.modify(Bucket.WORKERS, "cpu-0", lambda r: replace(r, ...))  # read-modify-write, retried
    async with registry.watch(Bucket.WORKERS) as changes:              # the current records, then every change
        async for change in changes: ...                               # CatalogChanged

Conflicts raise `shared.wire.RevisionConflict` (code `conflict`; `.key`, `.expected`,
`.actual`, where `.actual` is None when the key is absent). Transport failures raise the bus
errors (`NoResponders` when no registry runs, `DeadlineExceeded`).
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable

from shared.bus import Bus, Delivery, Subscription
from shared.events.registry import (
    Bucket, CatalogChanged, CatalogEntry, DeleteReply, GetReply, PutReply, Record, RegistryConflict, RegistryDelete,
    RegistryDeleted, RegistryGet, RegistryList, RegistryListing, RegistryPut, record_bucket,
    record_key,
)
from shared.subjects import registry_changed, registry_op
from shared.wire import RevisionConflict


def _conflict(reply: RegistryConflict) -> RevisionConflict:
    actual = reply.actual_revision or None
    return RevisionConflict(str(reply.bucket), reply.key, reply.expected_revision, actual)


class RegistryClient:
    """Catalog reads and compare-and-set writes through `tidal.v1.registry.*`."""

    def __init__(self, bus: Bus, *, timeout: float | None = None) -> None:
        self.bus = bus
        self.timeout = timeout  # None: the bus default deadline

    async def get(self, bucket: Bucket | str, key: str) -> CatalogEntry | None:
        reply = await self.bus.request(
            registry_op("get"), RegistryGet(bucket=Bucket(bucket), key=key), GetReply, timeout=self.timeout
        )
        return reply if isinstance(reply, CatalogEntry) else None

    async def list(self, bucket: Bucket | str, *, prefix: str = "", page: int = 1000) -> list[CatalogEntry]:
        """Every record of a bucket (all pages), in key order."""
        entries: list[CatalogEntry] = []
        after = ""
        while True:
            reply: RegistryListing = await self.bus.request(
                registry_op("list"), RegistryList(bucket=Bucket(bucket), prefix=prefix, after=after, limit=page),
                RegistryListing, timeout=self.timeout,
            )
            entries.extend(reply.entries)
            if not reply.more or not reply.entries:
                return entries
            after = reply.entries[-1].key

    async def put(self, record: Record, expected_revision: int, *, idempotency_key: str | None = None) -> int:
        """Create (`expected_revision=0`) or update; returns the new revision or raises RevisionConflict."""
        msg = RegistryPut(
            idempotency_key=idempotency_key or uuid.uuid4().hex, record=record, expected_revision=expected_revision
        )
        reply = await self.bus.request(registry_op("put"), msg, PutReply, timeout=self.timeout)
        if isinstance(reply, RegistryConflict):
            raise _conflict(reply)
        return reply.revision

    async def create(self, record: Record, *, idempotency_key: str | None = None) -> int:
        return await self.put(record, 0, idempotency_key=idempotency_key)

    async def delete(self, bucket: Bucket | str, key: str, expected_revision: int, *,
                     idempotency_key: str | None = None) -> bool:
        """Delete at `expected_revision`; False when the key was already absent. Raises RevisionConflict."""
        msg = RegistryDelete(
            idempotency_key=idempotency_key or uuid.uuid4().hex, bucket=Bucket(bucket), key=key,
            expected_revision=expected_revision,
        )
        reply = await self.bus.request(registry_op("delete"), msg, DeleteReply, timeout=self.timeout)
        if isinstance(reply, RegistryConflict):
            raise _conflict(reply)
        return isinstance(reply, RegistryDeleted)

    async def modify(
        self, bucket: Bucket | str, key: str, change: Callable[[Any | None], Record | None], *, attempts: int = 8
    ) -> CatalogEntry | None:
        """Read-modify-write with compare-and-set, retried on conflict.

        `change(current record or None)` returns the record to write, or None to leave it as it
        is. Returns the entry written (or the unchanged current one; None if absent and kept so).
        """
        for _ in range(attempts):
            current = await self.get(bucket, key)
            new = change(current.record if current is not None else None)
            if new is None:
                return current
            if record_bucket(new) != Bucket(bucket) or record_key(new) != key:
                raise ValueError(f"modify({bucket}/{key}) returned a record for {record_bucket(new)}/{record_key(new)}")
            try:
                revision = await self.put(new, current.revision if current is not None else 0)
            except RevisionConflict:
                continue  # someone wrote first: read again and re-apply the change
            return CatalogEntry(bucket=Bucket(bucket), key=key, revision=revision, record=new)
        raise RevisionConflict(str(bucket), key, -1, None)

    def watch(self, bucket: Bucket | str) -> "CatalogWatch":
        return CatalogWatch(self, Bucket(bucket))


class CatalogWatch:
    """The current records of a bucket (as `put` changes), then every change, in revision order per key.

    Subscribes to the change events before listing, so nothing written in between is missed;
    an event at or below the revision already delivered for its key is dropped.
    """

    def __init__(self, client: RegistryClient, bucket: Bucket) -> None:
        self.client = client
        self.bucket = bucket
        self.revisions: dict[str, int] = {}  # per key: the newest revision delivered
        self._queue: asyncio.Queue[CatalogChanged] = asyncio.Queue()
        self._sub: Subscription | None = None
        self._ready: list[CatalogChanged] = []

    async def start(self) -> "CatalogWatch":
        self._sub = await self.client.bus.subscribe(
            registry_changed(self.bucket), CatalogChanged, self._on_change, label="tidal.v1.evt.registry.*"
        )
        for entry in await self.client.list(self.bucket):
            self._ready.append(CatalogChanged(
                bucket=self.bucket, key=entry.key, revision=entry.revision, op="put", record=entry.record,
                ts=entry.updated_ts,
            ))
        return self

    async def _on_change(self, event: CatalogChanged, _ctx: Delivery) -> None:
        self._queue.put_nowait(event)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def __aenter__(self) -> "CatalogWatch":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __aiter__(self) -> "CatalogWatch":
        return self

    async def __anext__(self) -> CatalogChanged:
        while True:
            event = self._ready.pop(0) if self._ready else await self._queue.get()
            if event.revision <= self.revisions.get(event.key, 0):
                continue  # already delivered (the listing included it) or out of date
            self.revisions[event.key] = event.revision
            return event


__all__ = ["CatalogWatch", "RegistryClient"]

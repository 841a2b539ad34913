"""The registry's view of its own catalog for the Announcer: the store, without a bus round trip.

The registry announces itself like every service (ServiceRecord, heartbeats), but writes its
record straight into the KV buckets it owns rather than requesting its own API (NATS users in
compose/ do not let the registry send registry requests).
"""
from __future__ import annotations

from typing import Any, Callable

from shared.events.registry import Bucket, CatalogEntry, Record, RegistryConflict, RegistryDeleted, record_key
from shared.wire import RevisionConflict

from services.registry.store import CatalogStore


class LocalCatalog:
    def __init__(self, store: CatalogStore) -> None:
        self.store = store

    async def get(self, bucket: Bucket | str, key: str) -> CatalogEntry | None:
        return await self.store.get(Bucket(bucket), key)

    async def modify(
        self, bucket: Bucket | str, key: str, change: Callable[[Any | None], Record | None], *, attempts: int = 8
    ) -> CatalogEntry | None:
        for _ in range(attempts):
            current = await self.store.get(Bucket(bucket), key)
            new = change(current.record if current is not None else None)
            if new is None:
                return current
            outcome = await self.store.put(new, current.revision if current is not None else 0)
            if isinstance(outcome, RegistryConflict):
                continue
            return CatalogEntry(bucket=Bucket(bucket), key=record_key(new), revision=outcome.revision, record=new)
        raise RevisionConflict(str(bucket), key, -1, None)

    async def delete(self, bucket: Bucket | str, key: str, expected_revision: int) -> bool:
        outcome = await self.store.delete(Bucket(bucket), key, expected_revision)
        if isinstance(outcome, RegistryConflict):
            raise RevisionConflict(str(bucket), key, expected_revision, outcome.actual_revision or None)
        return isinstance(outcome, RegistryDeleted)

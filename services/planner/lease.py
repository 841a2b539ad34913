"""One planner decides: a lease record in the registry (JetStream KV, compare-and-set).

Each interval every planner calls `tick`. The holder rewrites the record on the revision it read
(renewal); a conflict means someone else holds it now. A standby watches the record's revision: when
it has not changed for `ttl_s` on the standby's own clock (the holder stopped renewing), it writes
the record on that revision with the next term — of two standbys racing, the compare-and-set lets
exactly one win. A holder that cannot reach the registry steps down after ttl_s / 2 without a
renewal, before any standby could take over. `release` (at stop) deletes the record so a standby
takes over at its next tick.
"""
from __future__ import annotations

import time

from shared.events.registry import Bucket, LeaseRecord
from shared.logging import get_logger
from shared.registry_client import RegistryClient
from shared.wire import RevisionConflict, TidalError

log = get_logger("tidal.planner.lease")


class Lease:
    def __init__(self, registry: RegistryClient, *, name: str, holder: str, ttl_s: float) -> None:
        self.registry = registry
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self.leader = False
        self.term = 0
        self._revision = 0  # the revision last written or observed
        self._changed_at = 0.0  # monotonic: when the observed revision last changed
        self._renewed_at = float("-inf")  # monotonic: our last successful write

    async def tick(self, now: float) -> bool:
        """Renew, or take over a stale lease; returns whether this planner holds it. `now`: monotonic."""
        try:
            held = await self._tick(now)
        except (TidalError, OSError) as exc:
            held = self.leader and now - self._renewed_at < self.ttl_s / 2
            log.warning("lease not renewed", lease=self.name, error=repr(exc), still_leader=held)
        if held != self.leader:
            log.info("lease acquired" if held else "lease lost", lease=self.name, holder=self.holder, term=self.term)
        self.leader = held
        return held

    async def _tick(self, now: float) -> bool:
        entry = await self.registry.get(Bucket.LEASES, self.name)
        if entry is None:
            return await self._write(now, 0, self.term + 1)
        record = entry.record
        assert isinstance(record, LeaseRecord)
        if record.holder == self.holder:
            self.term = record.term
            return await self._write(now, entry.revision, record.term)
        if entry.revision != self._revision:  # the holder is alive (it wrote since we last looked)
            self._revision, self._changed_at = entry.revision, now
            self.term = record.term
            return False
        if now - self._changed_at < max(self.ttl_s, record.ttl_s):
            return False
        log.info("lease stale; taking over", lease=self.name, previous=record.holder, term=record.term + 1)
        return await self._write(now, entry.revision, record.term + 1)

    async def _write(self, now: float, revision: int, term: int) -> bool:
        record = LeaseRecord(name=self.name, holder=self.holder, term=term, ttl_s=self.ttl_s, renewed_ts=time.time())
        try:
            self._revision = await self.registry.put(record, revision)
        except RevisionConflict:
            self._revision, self._changed_at = 0, now  # someone else wrote: observe it next tick
            return False
        self.term, self._changed_at, self._renewed_at = term, now, now
        return True

    async def release(self) -> None:
        """Give the lease up (at stop), so a standby need not wait for it to go stale."""
        if not self.leader:
            return
        self.leader = False
        try:
            await self.registry.delete(Bucket.LEASES, self.name, self._revision)
        except (TidalError, OSError) as exc:
            log.warning("lease not released; it will go stale", lease=self.name, error=repr(exc))


__all__ = ["Lease"]

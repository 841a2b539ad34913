"""Worker and service liveness: heartbeats in, catalog writes and change events out.

Heartbeats (`tidal.v1.evt.worker.heartbeat`, `tidal.v1.evt.service.heartbeat`) feed two
`LivenessTracker`s (workers; service processes). A timer wakes at the next moment a peer
could die; a peer silent for `dead_after` is marked dead in its record (WorkerRecord.state
DEAD, ServiceRecord.state "dead") and the change is published; a heartbeat brings it back.
A gpu_worker's heartbeat also keeps its process's ServiceRecord alive (its `service_id`; older
workers sent none, their `incarnation` was the service id). Dead service records are deleted after `forget_after`
(worker records stay: a worker is a device, it may come back).

Every record write is a compare-and-set on the revision this actor last saw; on a conflict
(the worker re-registered meanwhile) it re-reads and applies the change again. A write that
fails (NATS away) stays pending and is retried on the next tick.
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import msgspec

from shared.actors import Actor
from shared.bus import Delivery
from shared.events.base import ID_PATTERN
from shared.events.registry import Bucket, CatalogEntry, RegistryList, RegistryWritten, ServiceHeartbeat
from shared.events.worker import WorkerHeartbeat, WorkerState
from shared.logging import get_logger
from shared.subjects import service_heartbeat, worker_heartbeat

from services.registry.liveness import Change, LivenessTracker, PeerKey, needs_write
from services.registry.store import CatalogStore

log = get_logger("tidal.registry.liveness")

_SERVICE_ID = re.compile(ID_PATTERN)
MAX_TICK_S = 0.25  # upper bound on the timer's sleep (new peers, pending retries)
STALL_FRACTION = 0.5  # a stall of the registry's own longer than this x dead_after makes it "deaf" (_deaf)


@dataclass(frozen=True)
class Desired:
    """What a record should say: its state and (when known) when it was last heard from."""

    state: str
    heartbeat_ts: float | None
    publish: bool  # a state change (published) or only a fresher heartbeat time (not published)


class LivenessActor(Actor):
    def __init__(self, store: CatalogStore, *, dead_after: float, heartbeat_interval: float,
                 forget_after: float | None = None, self_service_id: str | None = None) -> None:
        super().__init__("registry-liveness")
        self.store = store
        self.dead_after = dead_after
        # A worker's record gets every heartbeat's time (`tidal status` shows its age); a service
        # process's only every dead_after (its health reply is what status shows).
        self.touch_every = {str(Bucket.WORKERS): heartbeat_interval / 2, str(Bucket.SERVICES): dead_after}
        self.workers = LivenessTracker(dead_after)
        self.services = LivenessTracker(dead_after, forget_after=forget_after or max(30.0, 10 * dead_after))
        self._seen: dict[PeerKey, CatalogEntry] = {}  # last entry read or written, for compare-and-set
        self._pending: dict[PeerKey, Desired] = {}
        # telling "this registry was deaf" from "peers died" (_deaf): its own process's heartbeat, the
        # last tick, the last slow write
        self.self_key: PeerKey | None = (str(Bucket.SERVICES), self_service_id) if self_service_id else None
        self._last_tick: float | None = None
        self._slow_io_at: float | None = None
        self._slow_io_s = 0.0

    async def on_start(self) -> None:
        await self.store.open(self.bus)
        await self._seed()
        await self.bind(worker_heartbeat(), WorkerHeartbeat, self.on_worker_heartbeat)
        await self.bind(service_heartbeat(), ServiceHeartbeat, self.on_service_heartbeat)
        self.spawn("expire", self._expire_loop)

    async def _seed(self) -> None:
        """Track every catalogued peer as if heard now: one that died while no registry ran is
        marked dead `dead_after` after this start (a stale timestamp alone is not proof)."""
        now = time.monotonic()
        for bucket, tracker, dead in ((Bucket.WORKERS, self.workers, WorkerState.DEAD), (Bucket.SERVICES, self.services, "dead")):
            after = ""
            while True:
                page = await self.store.list(RegistryList(bucket=bucket, after=after))
                for entry in page.entries:
                    key = (str(bucket), entry.key)
                    self._seen[key] = entry
                    tracker.seed(key, now, alive=entry.record.state != dead)  # type: ignore[union-attr]
                if not page.more:
                    break
                after = page.entries[-1].key
        log.info("liveness seeded from the catalog", workers=len(self.workers), services=len(self.services))

    # --- heartbeats -----------------------------------------------------------------------
    async def on_worker_heartbeat(self, hb: WorkerHeartbeat, _ctx: Delivery) -> None:
        now, wall = time.monotonic(), time.time()
        key = (str(Bucket.WORKERS), hb.worker_id)
        change = self.workers.heard(key, now, hb.incarnation)
        await self._heard(key, change, str(hb.state), wall)
        # the worker process's own ServiceRecord (older workers: service id == incarnation)
        service = hb.service_id or hb.incarnation
        if _SERVICE_ID.fullmatch(service):
            proc = (str(Bucket.SERVICES), service)
            proc_change = self.services.heard(proc, now, hb.incarnation)
            await self._heard(proc, proc_change, str(hb.state), wall)

    async def on_service_heartbeat(self, hb: ServiceHeartbeat, _ctx: Delivery) -> None:
        key = (str(Bucket.SERVICES), hb.service_id)
        change = self.services.heard(key, time.monotonic(), hb.service_id)
        await self._heard(key, change, hb.state, time.time())

    async def _heard(self, key: PeerKey, change: Change | None, state: str, wall: float) -> None:
        entry = self._seen.get(key)
        if entry is None:
            entry = await self._read(key)
            if entry is None:
                return  # not registered (yet): nothing to update
        record = entry.record
        stored_state = str(record.state)  # type: ignore[union-attr]
        if change is None and not needs_write(stored_state, record.last_heartbeat_ts, state, wall, self.touch_every[key[0]]):  # type: ignore[union-attr]
            return
        if change is not None and change.alive and stored_state in ("dead", str(WorkerState.DEAD)):
            log.info("peer alive again", bucket=key[0], key=key[1], restarted=change.restarted)
        await self._apply(key, Desired(state, wall, publish=stored_state != state))

    # --- the timer ------------------------------------------------------------------------
    async def _expire_loop(self) -> None:
        while True:
            due = [d for d in (self.workers.next_due(), self.services.next_due()) if d is not None]
            delay = MAX_TICK_S if not due else min(MAX_TICK_S, max(0.005, min(due) - time.monotonic()))
            await asyncio.sleep(delay)
            async with self.turn():
                await self.tick(time.monotonic())

    async def tick(self, now: float) -> None:
        """Mark silent peers dead, forget long-dead services, retry failed writes."""
        if self._deaf(now):
            self.workers.grace(now)
            self.services.grace(now)
        self._last_tick = now
        for change in self.workers.expire(now) + self.services.expire(now):
            log.warning("peer marked dead", bucket=change.key[0], key=change.key[1], silent_s=round(change.silent_s, 3))
            dead = str(WorkerState.DEAD) if change.key[0] == Bucket.WORKERS else "dead"
            self._pending[change.key] = Desired(dead, None, publish=True)
        for key in self.services.forgettable(now):
            await self._forget(key)
        for key, desired in list(self._pending.items()):
            if self._pending.get(key) is desired:
                await self._apply(key, desired)

    def _deaf(self, now: float) -> bool:
        """Whether this registry, not its peers, was out of touch: its own loop stalled between two
        ticks, a write of its stalled (JetStream electing a leader holds every put), or it stopped
        hearing its own heartbeat (its NATS node is cut off). Then nobody is marked dead now: every
        peer gets `dead_after` from here (LivenessTracker.grace)."""
        stall = STALL_FRACTION * self.dead_after
        why = None
        if self._last_tick is not None and now - self._last_tick > max(stall, MAX_TICK_S * 2):
            why = f"this registry's loop stalled {now - self._last_tick:.1f}s"
        elif self._slow_io_at is not None:
            why = f"a catalog write took {self._slow_io_s:.1f}s (NATS electing a leader?)"
        elif self.self_key is not None and self.services.silent(self.self_key, now):
            why = "this registry stopped hearing its own heartbeat (its NATS server is cut off?)"
        self._slow_io_at = None
        if why is not None:
            log.warning("the registry was out of touch; every peer gets a grace before it can be marked dead",
                        why=why, grace_s=self.dead_after)
        return why is not None

    # --- catalog writes -------------------------------------------------------------------
    async def _read(self, key: PeerKey) -> CatalogEntry | None:
        entry = await self.store.get(Bucket(key[0]), key[1])
        if entry is None:
            self._seen.pop(key, None)
        else:
            self._seen[key] = entry
        return entry

    async def _apply(self, key: PeerKey, desired: Desired, attempts: int = 4) -> None:
        """Write `desired` into the record with compare-and-set, re-reading on conflict."""
        self._pending[key] = desired
        try:
            for _ in range(attempts):
                entry = self._seen.get(key) or await self._read(key)
                if entry is None:
                    break  # deregistered: nothing to mark
                record = entry.record
                state = WorkerState(desired.state) if key[0] == Bucket.WORKERS else desired.state
                if desired.heartbeat_ts is None and record.state == state:  # type: ignore[union-attr]
                    break  # already says so (another registry instance wrote it)
                changes: dict[str, object] = {"state": state}
                if desired.heartbeat_ts is not None:
                    changes["last_heartbeat_ts"] = desired.heartbeat_ts
                new = msgspec.structs.replace(record, **changes)
                started = time.monotonic()
                try:
                    outcome = await self.store.put(new, entry.revision, publish=desired.publish)
                finally:
                    self._timed_io(time.monotonic() - started)
                if isinstance(outcome, RegistryWritten):
                    self._seen[key] = CatalogEntry(bucket=entry.bucket, key=entry.key, revision=outcome.revision, record=new)
                    break
                await self._read(key)  # someone wrote first: apply on top of their record
            else:
                log.warning("liveness write kept losing compare-and-set; will retry", bucket=key[0], key=key[1])
                return
        except Exception as exc:  # NATS away: keep it pending, the next tick retries
            log.warning("liveness write failed; will retry", bucket=key[0], key=key[1], error=repr(exc))
            return
        if self._pending.get(key) is desired:
            del self._pending[key]

    def _timed_io(self, took_s: float) -> None:
        if took_s > STALL_FRACTION * self.dead_after:
            self._slow_io_at, self._slow_io_s = time.monotonic(), took_s

    async def _forget(self, key: PeerKey) -> None:
        try:
            entry = await self._read(key)
        except Exception:
            return
        self._pending.pop(key, None)
        self._seen.pop(key, None)
        if entry is not None and str(entry.record.state) == "dead":  # type: ignore[union-attr]
            try:
                outcome = await self.store.delete(Bucket(key[0]), key[1], entry.revision)
            except Exception as exc:  # a later registry start seeds it again and retries
                log.warning("dead service record not deleted", key=key[1], error=repr(exc))
                return
            log.info("forgot dead service", key=key[1], outcome=type(outcome).__name__)

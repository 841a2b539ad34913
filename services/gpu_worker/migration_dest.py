"""The destination of a KV migration: reservations, expected transfers, the commit.

    MigrateIn(reserve_tokens=N)   hold KV blocks for N tokens under the request id
    MigrateKvStage(key, [a, b))   grow them if needed; expect data-plane transfer `key` into blocks [a, b)
    Assignment(kv_computed_tokens=N)   the commit (worker.assign): admit the request on those blocks
    MigrateKvCancel               drop the expected transfers, free the blocks

A reservation not committed within its `hold_s` (renewed by every stage) is released: its
source gave up without saying so. So is one whose source worker is lost (a heartbeat with another
incarnation, or silent for `dead_after`: a killed source never answers its MigrateOut), at once,
and one whose request is assigned here anew without moved KV (the dispatcher's re-dispatch after
the source died, or the source's token-mode hand-over): the assignment then runs as any other. Blocks are freed only once nothing can still be
written into them: a transfer already under way is awaited until the data plane hands its
destination back (it does so only when no receive into it is posted).
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.gpu_worker.engine.sampling_params import SamplingParamsError
from shared.events import AssignAccepted, AssignRejected, Assignment
from shared.events.ctl import CtlDone, CtlRefused, CtlReply, MigrateIn, MigrateKvCancel, MigrateKvStage
from shared.logging import get_logger

if TYPE_CHECKING:
    from services.gpu_worker.admission import Active
    from services.gpu_worker.dataplane import WorkerDataPlane
    from services.gpu_worker.instance import ModelInstance

log = get_logger("tidal.gpu_worker.migration")

COMMITTED_MEMORY = 10_000  # committed moves remembered for a late withdrawal
SINK_SETTLE_S = 30.0  # a transfer under way when a reservation is dropped: how long to wait for it to end
EXPIRY_TICK_S = 0.25  # how often held reservations are checked (hold, the source's liveness)
Heard = Callable[[str], "tuple[float, str] | None"]  # worker -> (last heartbeat, monotonic; its incarnation)


@dataclass(slots=True)
class Reservation:
    request_id: str
    source: str
    instance: "ModelInstance"
    tokens: int
    expected_tokens: int
    hold_s: float
    expires_at: float  # monotonic
    sinks: dict[str, Any] = field(default_factory=dict)  # key -> transfer.Sink
    source_incarnation: str | None = None  # the source's process when it reserved (None: not heard yet)


class KvInbound:
    """The worker's reservations for incoming KV migrations (touched on the event loop only)."""

    def __init__(self, worker_id: str, instances: "dict[str, ModelInstance]", active: "dict[str, Active]",
                 dataplane: "WorkerDataPlane", *, draining: Callable[[], bool], heard: Heard,
                 dead_after: Callable[[], float]) -> None:
        """`active`: the worker's running requests (a withdrawn commit leaves them); `heard`: the
        other workers' heartbeats; `dead_after`: the registry's silence threshold."""
        self.worker_id, self.instances, self.active, self.dataplane = worker_id, instances, active, dataplane
        self._draining, self._heard, self._dead_after = draining, heard, dead_after
        self.reservations: dict[str, Reservation] = {}
        # request id -> source, for moves committed here: a source whose commit went unanswered
        # cancels, and the copy running here must then go quietly (bounded: old entries drop)
        self.committed: OrderedDict[str, str] = OrderedDict()
        self._expiry: asyncio.Task[None] | None = None

    def _done(self, msg: MigrateIn | MigrateKvStage | MigrateKvCancel, detail: str) -> CtlDone:
        return CtlDone(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                       worker_id=self.worker_id, detail=detail)

    def _refused(self, msg: MigrateIn | MigrateKvStage | MigrateKvCancel, code: str, message: str) -> CtlRefused:
        return CtlRefused(idempotency_key=msg.idempotency_key, command=type(msg).__name__,
                          worker_id=self.worker_id, code=code, message=message)  # type: ignore[arg-type]

    # --- MigrateIn(reserve_tokens > 0) ------------------------------------------------------------
    async def reserve(self, msg: MigrateIn) -> CtlReply:
        inst = self.instances.get(msg.instance_id)
        if inst is None:
            return self._refused(msg, "not_found", f"no instance {msg.instance_id} on {self.worker_id}")
        if self._draining():
            return self._refused(msg, "busy", f"worker {self.worker_id} is draining")
        if msg.kv_block_tokens and msg.kv_block_tokens != inst.engine.blocks.block_size:
            return self._refused(msg, "invalid", f"KV blocks hold {inst.engine.blocks.block_size} tokens here, "
                                                 f"{msg.kv_block_tokens} on {msg.source}: KV cannot move as is")
        if msg.adapter is not None and msg.adapter not in inst.adapters:
            return self._refused(msg, "not_found", f"adapter {msg.adapter!r} is not registered on {self.worker_id}")
        if msg.request_id in self.active:
            return self._refused(msg, "busy", f"request {msg.request_id} already runs on {self.worker_id}")
        held = self.reservations.get(msg.request_id)
        if held is not None and held.source != msg.source:
            return self._refused(msg, "busy", f"{msg.request_id} is being received from {held.source}")
        views = await inst.reserve_kv(msg.request_id, msg.reserve_tokens, msg.expected_tokens, 0, 0)
        if views is None:
            if held is None:
                await inst.release_kv(msg.request_id)  # nothing was held before: leave nothing
            return self._refused(msg, "insufficient_memory",
                                 f"no room for {msg.reserve_tokens} tokens of KV on {inst.instance_id}")
        if held is None:
            held = Reservation(msg.request_id, msg.source, inst, msg.reserve_tokens, msg.expected_tokens, msg.hold_s, 0.0)
            heard = self._heard(msg.source)
            held.source_incarnation = heard[1] if heard is not None else None
            self.reservations[msg.request_id] = held
        held.tokens = max(held.tokens, msg.reserve_tokens)
        self._renew(held)
        return self._done(msg, f"KV for {held.tokens} tokens of {msg.request_id} reserved on {inst.instance_id}")

    # --- MigrateKvStage ----------------------------------------------------------------------------
    async def stage(self, msg: MigrateKvStage) -> CtlReply:
        held = self.reservations.get(msg.request_id)
        if held is None or held.source != msg.source:
            return self._refused(msg, "not_found", f"no KV reservation for {msg.request_id} from {msg.source}")
        plane = self.dataplane.plane
        if plane is None:
            return self._refused(msg, "unsupported", self.dataplane.unavailable or "no data plane")
        if msg.first_block > msg.last_block:
            return self._refused(msg, "invalid", f"block range [{msg.first_block}, {msg.last_block}) is empty")
        bs = held.instance.engine.blocks.block_size
        tokens = max(held.tokens, msg.reserve_tokens, msg.last_block * bs)
        views = await held.instance.reserve_kv(msg.request_id, tokens, held.expected_tokens, msg.first_block,
                                               msg.last_block)
        if self.reservations.get(msg.request_id) is not held:  # cancelled meanwhile
            return self._refused(msg, "not_found", f"the reservation for {msg.request_id} was released")
        if views is None:
            return self._refused(msg, "insufficient_memory", f"no room for {tokens} tokens of KV")
        held.tokens = tokens
        if msg.key in held.sinks and not held.sinks[msg.key].done:  # a retried stage: already expected
            return self._done(msg, f"expecting {msg.key}")
        held.sinks[msg.key] = plane.inbox.expect(msg.key, views)
        self._renew(held)
        return self._done(msg, f"expecting {msg.key}: blocks [{msg.first_block}, {msg.last_block})")

    # --- MigrateKvCancel / expiry ------------------------------------------------------------------
    async def cancel(self, msg: MigrateKvCancel) -> CtlReply:
        held = self.reservations.get(msg.request_id)
        if held is None and self.committed.get(msg.request_id) == msg.source:
            return await self._withdraw(msg)
        if held is None or held.source != msg.source:
            return self._done(msg, f"no reservation for {msg.request_id}: nothing to release")
        freed = await self._release(held, f"cancelled by {msg.source}: {msg.reason}")
        return self._done(msg, f"released {freed} KV blocks of {msg.request_id}")

    async def _withdraw(self, msg: MigrateKvCancel) -> CtlReply:
        """The source gave up on a commit this worker did take (its reply was lost or late) and
        resumed the request itself: drop the copy here without ending the client's stream."""
        del self.committed[msg.request_id]
        entry = self.active.pop(msg.request_id, None)
        if entry is None:
            return self._done(msg, f"{msg.request_id} already ended here")
        await entry.instance.detach(msg.request_id)
        log.warning("committed KV migration withdrawn by its source", request_id=msg.request_id, source=msg.source,
                    reason=msg.reason)
        return self._done(msg, f"{msg.request_id} withdrawn: the source continues it")

    async def _release(self, held: Reservation, why: str) -> int:
        if self.reservations.get(held.request_id) is held:
            del self.reservations[held.request_id]
        plane = self.dataplane.plane
        for key, sink in held.sinks.items():
            if plane is not None:
                plane.inbox.forget(key)  # not started yet: fails the sink now
            try:
                await sink.wait(timeout=SINK_SETTLE_S)  # under way: ends once no receive is posted into it
            except Exception:  # noqa: BLE001 - failed or timed out: either way it is over for us
                pass
        freed = await held.instance.release_kv(held.request_id)
        log.info("KV reservation released", request_id=held.request_id, source=held.source, blocks=freed, why=why)
        return freed

    def _renew(self, held: Reservation) -> None:
        held.expires_at = time.monotonic() + held.hold_s
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while self.reservations:
            now = time.monotonic()
            for held in list(self.reservations.values()):
                why = self._source_lost(held, now)
                if why is None and held.expires_at > now:
                    continue
                why = why or f"not committed within {held.hold_s}s"
                log.warning("KV reservation released: nothing will commit it", request_id=held.request_id,
                            source=held.source, why=why)
                await self._release(held, why)
            await asyncio.sleep(EXPIRY_TICK_S)

    def _source_lost(self, held: Reservation, now: float) -> str | None:
        """Why the reservation's source can no longer commit it (its worker is lost), or None."""
        heard = self._heard(held.source)
        if heard is None or held.expires_at == float("inf"):  # unknown yet, or its commit is under way
            return None
        if held.source_incarnation is None:
            held.source_incarnation = heard[1]
        if heard[1] != held.source_incarnation:
            return f"its source {held.source} restarted"
        if now - heard[0] > self._dead_after():
            return f"its source {held.source} is silent ({now - heard[0]:.1f} s): lost"
        return None

    async def drop(self, request_id: str, why: str) -> None:
        """Release `request_id`'s reservation (it is assigned here anew, without moved KV)."""
        held = self.reservations.get(request_id)
        if held is not None:
            log.warning("KV reservation released: its request is assigned here afresh", request_id=request_id,
                        source=held.source, why=why)
            await self._release(held, why)

    # --- the commit (worker.assign with kv_computed_tokens) ----------------------------------------
    async def commit(self, a: Assignment) -> AssignAccepted | AssignRejected | None:
        """Admit `a` on its reserved blocks; None: accepted (the caller records it)."""
        held = self.reservations.get(a.request_id)
        if held is None or held.instance.instance_id != a.instance_id:
            return self._rejected(a, f"no KV reservation for {a.request_id} on {a.instance_id}")
        held.expires_at = float("inf")  # not released under the commit's feet
        started = time.monotonic()
        why = await self._admit(held, a)
        if why is not None:
            self._renew(held)  # the source cancels it (or it expires)
            return self._rejected(a, why)
        if self.reservations.get(a.request_id) is held:
            del self.reservations[a.request_id]
        self.committed[a.request_id] = held.source
        while len(self.committed) > COMMITTED_MEMORY:
            self.committed.popitem(last=False)
        log.info("KV migration committed", request_id=a.request_id, source=held.source, kv_tokens=a.kv_computed_tokens,
                 next_seq=a.next_seq, worker=self.worker_id, attach_ms=round((time.monotonic() - started) * 1e3, 2))
        return None

    async def _admit(self, held: Reservation, a: Assignment) -> str | None:
        for key, sink in held.sinks.items():
            try:
                await sink.wait(timeout=5.0)  # acknowledged to the source already: settles at once
            except Exception as exc:  # noqa: BLE001
                return f"KV transfer {key} did not complete here: {exc}"
        try:
            await held.instance.attach(a)
        except (ValueError, SamplingParamsError) as exc:
            return f"the engine cannot continue {a.request_id} on the moved KV: {exc}"
        return None

    def _rejected(self, a: Assignment, message: str) -> AssignRejected:
        log.warning("KV migration commit refused", request_id=a.request_id, error=message)
        return AssignRejected(request_id=a.request_id, worker_id=self.worker_id, reason="kv_unavailable",
                              message=message[:2000])

    async def close(self) -> None:
        """At stop: expect nothing more (the blocks go with the engine; nothing waits on transfers)."""
        if self._expiry is not None:
            self._expiry.cancel()
        plane = self.dataplane.plane
        for held in self.reservations.values():
            for key in held.sinks:
                if plane is not None:
                    plane.inbox.forget(key)
        self.reservations.clear()

"""The source of a KV migration (Llumnix-style pre-copy, the KV path of MELL §V).

    reserve   MigrateIn(reserve_tokens) -> destination holds blocks for the request
    pre-copy  per stage, while the request keeps decoding here: MigrateKvStage(key, [sent, full))
              -> destination expects `key` into those blocks; the FULL blocks [sent, full) go
              over the data plane (TrafficClass.KV) and are acknowledged, verified
              (repeat while more than STOP_BLOCKS new blocks filled up, at most MAX_STAGES)
    stop      between two steps the request leaves the engine with its blocks held
              (`stop_for_handover`); the rest — new full blocks and the partial tail — goes
              as the final stage
    commit    an Assignment with `kv_computed_tokens` and the stream's `next_seq` on the
              destination's assign subject: it attaches the request on the moved blocks
    release   the source frees its blocks

Downtime = stop -> the destination's AssignAccepted (sent once its engine holds the request).

Failures: the destination lost or refusing (ctl timeout, `peer_lost`, ...) -> the request
goes on here, re-attached on its held blocks if it had stopped; the stream stays exact. A
`corrupt` or `truncated` chunk, or a destination whose data plane cannot be reached ->
the destination releases its blocks and the move falls back to token mode (re-prefill there). The request ending meanwhile -> the reservation is
released and the reply is `not_found`.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from services.gpu_worker.migration_tokens import hand_over, move_by_tokens, refused, resumed_on_source
from services.gpu_worker.transfer import TrafficClass, TransferFailed
from shared.events import AssignAccepted, AssignReply
from shared.events.ctl import (
    CtlDone, CtlRefused, CtlReply, MigrateIn, MigrateKvCancel, MigrateKvStage, MigrateOut, MigrationReport,
)
from shared.logging import get_logger
from shared.subjects import worker_assign, worker_migrate
from shared.wire import DeadlineExceeded, TidalError

if TYPE_CHECKING:
    from services.gpu_worker.admission import Active
    from services.gpu_worker.instance_kv import KvSnapshot, Stopped
    from services.gpu_worker.worker_context import WorkerContext

log = get_logger("tidal.gpu_worker.migration")

MAX_STAGES = 8  # pre-copy stages before the final stop, at most
STOP_BLOCKS = 2  # stop once a stage would move this few new full blocks (per layer) or fewer
CTL_TIMEOUT_S = 5.0  # a destination answers stages with bookkeeping and one engine-thread call
TRANSFER_TIMEOUT_S = 60.0
ASSIGN_TIMEOUT_S = 10.0
COMMIT_ATTEMPTS = 3  # same idempotency key each time: the destination replays, never attaches twice
HOLD_S = 30.0  # the destination drops an uncommitted reservation after this long without a stage
# the destination is alive (it answered) but its KV did not arrive intact, or its data plane
# cannot be reached: move by tokens instead
FALLBACK_REASONS = ("corrupt", "truncated", "unreachable")


class _Refused(Exception):
    """The destination said no (CtlRefused / AssignRejected)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Ended(Exception):
    """The request finished or was aborted here before it could move."""


class KvMove:
    def __init__(self, worker: "WorkerContext", msg: MigrateOut, entry: "Active", started: float) -> None:
        self.worker, self.msg, self.entry, self.started = worker, msg, entry, started
        self.inst = entry.instance
        self.rid = msg.request_id
        self.nonce = uuid.uuid4().hex[:8]
        self.sent = 0  # blocks [0, sent) of every layer are on the destination
        self.preemptions = 0
        self.stages = 0
        self.kv_bytes = 0
        self.reserved = False
        self.stopped: Stopped | None = None
        self.handle: Any = None

    # --- the protocol ------------------------------------------------------------------------------
    async def run(self) -> CtlReply:
        try:
            return await self._move()
        except _Ended as exc:
            log.info("request ended before it could move", request_id=self.rid, at=str(exc))
            self._cancel_remote("the request ended on the source")
            return refused(self.worker, self.msg, "not_found", f"request {self.rid} ended before it could move")
        except TransferFailed as exc:
            if exc.reason in FALLBACK_REASONS:
                return await self._fall_back(f"{exc.reason}: {exc}")
            return await self._stay(f"data plane: {exc.reason}: {exc}")
        except _Refused as exc:
            if not self.reserved:  # refused at the reservation: nothing happened anywhere
                return refused(self.worker, self.msg, exc.code, f"destination {self.msg.destination}: {exc}")
            return await self._stay(f"destination refused: {exc}")
        except (TidalError, OSError, asyncio.TimeoutError) as exc:
            return await self._stay(f"destination unreachable: {exc!r}")

    async def _move(self) -> CtlReply:
        snap = await self.inst.kv_snapshot(self.rid, 0)
        if snap is None:
            raise _Ended("before the reservation")
        a = self.entry.assignment
        bs = self.inst.engine.blocks.block_size
        await self._ctl(MigrateIn(
            idempotency_key=f"kv-in-{self.rid}-{self.nonce}"[:128], request_id=self.rid, source=self.worker.worker_id,
            instance_id=self.msg.destination_instance, mode="kv", reserve_tokens=snap.progress.num_tokens + 4 * bs,
            expected_tokens=len(a.prompt_token_ids) + a.sampling.max_tokens, kv_block_tokens=bs, adapter=a.adapter,
            hold_s=HOLD_S,
        ))
        self.reserved = True
        link = await self.worker.dataplane.plane.link(self.msg.destination)
        await self._precopy(link, snap)
        stopped = await self.inst.stop_for_handover(self.rid, self.sent, self.preemptions)
        if stopped is None:
            raise _Ended("at the final stop")
        self.stopped = stopped
        return await self._finish(link, stopped)

    async def _precopy(self, link: Any, snap: "KvSnapshot") -> None:
        """Send the full blocks in stages while the request keeps decoding here."""
        self.preemptions = snap.progress.num_preemptions
        for stage in range(MAX_STAGES):
            if stage:
                snap = await self.inst.kv_snapshot(self.rid, self.sent)
                if snap is None:
                    raise _Ended(f"during pre-copy stage {stage}")
            p = snap.progress
            new = p.full_blocks - self.sent
            if p.num_preemptions != self.preemptions or new <= 0 or (stage and new <= STOP_BLOCKS):
                return  # converged (or preempted: the final stop resends everything)
            await self._stage(link, self.sent, p.full_blocks, p.num_tokens, snap.views, final=False)
            self.sent = p.full_blocks

    async def _finish(self, link: Any, stopped: "Stopped") -> CtlReply:
        """The final stop: the remaining blocks, the commit, the source's blocks freed."""
        d = stopped.detached
        num_tokens = len(d.prompt_token_ids) + len(d.output_token_ids)
        if stopped.last_block > stopped.first_block:
            await self._stage(link, stopped.first_block, stopped.last_block, num_tokens, stopped.views, final=True)
        a = self.entry.assignment
        commit = msgspec.structs.replace(
            a, idempotency_key=f"{self.rid}:kv:{self.nonce}"[:128], instance_id=self.msg.destination_instance,
            resume_token_ids=d.output_token_ids, next_seq=stopped.next_seq, kv_computed_tokens=d.num_computed_tokens,
            handover=a.handover + 1,  # the destination's chunks take the stream over from next_seq (the fence)
        )
        sent_at = time.monotonic()
        reply = await self._commit(commit)
        if not isinstance(reply, AssignAccepted):
            raise _Refused(reply.reason, reply.message)
        resumed_at = time.monotonic()
        self.worker.active.pop(self.rid, None)
        freed = await self.inst.release_kv(self.rid)
        report = MigrationReport(
            requested_mode="kv", mode="kv", stages=self.stages, kv_bytes=self.kv_bytes, tokens=num_tokens,
            kv_tokens=d.num_computed_tokens, downtime_s=resumed_at - stopped.stopped_at,
            total_s=resumed_at - self.started,
        )
        log.info("request migrated by KV", request_id=self.rid, destination=self.msg.destination, stages=self.stages,
                 kv_bytes=self.kv_bytes, tokens=num_tokens, downtime_ms=round(report.downtime_s * 1e3, 2),
                 stop_to_commit_ms=round((sent_at - stopped.stopped_at) * 1e3, 2),
                 commit_ms=round((resumed_at - sent_at) * 1e3, 2), blocks_freed=freed)
        return CtlDone(idempotency_key=self.msg.idempotency_key, command="MigrateOut", worker_id=self.worker.worker_id,
                       detail=f"{self.rid} moved to {self.msg.destination} with the KV of {d.num_computed_tokens} tokens",
                       migration=report)

    async def _commit(self, commit: Any) -> AssignReply:
        """Send the commit; on a timeout send it AGAIN under the same idempotency key: a destination
        that did attach answers with a replay of its acceptance, so an ambiguous first try never
        leaves the request running on both workers. No responders (the process is gone) or every
        try timing out -> the request resumes here (a destination that stays silent that long is
        hung, and its copy is cancelled by `_stay`)."""
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                return await self.worker.bus.request(worker_assign(self.msg.destination), commit, AssignReply,
                                                     timeout=ASSIGN_TIMEOUT_S)
            except DeadlineExceeded:
                log.warning("KV commit unanswered; retrying under the same key", request_id=self.rid,
                            attempt=attempt + 1, destination=self.msg.destination)
        raise DeadlineExceeded(f"commit of {self.rid} unanswered after {COMMIT_ATTEMPTS} tries")

    async def _stage(self, link: Any, first: int, last: int, num_tokens: int, views: list[Any], *, final: bool) -> None:
        key = f"kv:{self.rid}:{self.nonce}:{self.stages}"
        asked = time.monotonic()
        await self._ctl(MigrateKvStage(
            idempotency_key=f"kv-stage-{self.rid}-{self.nonce}-{self.stages}"[:128], request_id=self.rid,
            source=self.worker.worker_id, stage=self.stages, key=key, first_block=first, last_block=last,
            reserve_tokens=num_tokens, final=final,
        ))
        self.handle = await link.submit(views, kind=TrafficClass.KV, key=key, request_id=self.rid)
        receipt = await self.handle.wait(timeout=TRANSFER_TIMEOUT_S)
        self.handle = None
        self.stages += 1
        self.kv_bytes += receipt.total_bytes
        log.debug("KV stage sent", request_id=self.rid, stage=self.stages - 1, blocks=(first, last), final=final,
                 bytes=receipt.total_bytes, ctl_ms=round((time.monotonic() - asked - receipt.seconds) * 1e3, 2),
                 transfer_ms=round(receipt.seconds * 1e3, 2))

    async def _ctl(self, cmd: msgspec.Struct, timeout: float = CTL_TIMEOUT_S) -> CtlDone:
        reply = await self.worker.bus.request(worker_migrate(self.msg.destination), cmd, CtlReply, timeout=timeout)
        if isinstance(reply, CtlRefused):
            raise _Refused(reply.code, reply.message)
        return reply

    # --- failures ----------------------------------------------------------------------------------
    async def _stay(self, why: str) -> CtlReply:
        """The destination is gone or refused: the request goes on here, exactly where it was."""
        if self.handle is not None:
            self.handle.cancel()
        self._cancel_remote(why)
        if self.stopped is not None:
            await self._resume_here()
        log.warning("KV migration failed; the request continues on the source", request_id=self.rid,
                    destination=self.msg.destination, error=why)
        return refused(self.worker, self.msg, "busy",
                       f"destination {self.msg.destination} did not take {self.rid} ({why}); it continues here")

    async def _resume_here(self) -> None:
        stopped = self.stopped
        assert stopped is not None
        a = self.entry.assignment
        # it goes on as a newer assignment than the one offered to the destination (which is told to
        # drop any copy it started: a commit left unanswered is ambiguous)
        offered = msgspec.structs.replace(a, handover=a.handover + 1)
        local = resumed_on_source(self.worker, offered, self.msg.destination,
                                  idempotency_key=f"{self.rid}:resume:{self.nonce}"[:128], next_seq=stopped.next_seq,
                                  resume_token_ids=stopped.detached.output_token_ids, kv_computed_tokens=0)
        self.entry.assignment = local
        try:
            await self.inst.resume_detached(stopped.detached, stopped.next_seq, (local.attempt, local.handover))
        except ValueError as exc:  # should not happen: re-prefill from its tokens instead
            log.error("re-attaching on the held blocks failed; re-prefilling", request_id=self.rid, error=str(exc))
            await self.inst.release_kv(self.rid)
            self.worker.resume_here(local)
            return
        if self.entry.aborted:  # its abort came while it was out of the engine
            self.inst.abort(self.rid)

    async def _fall_back(self, why: str) -> CtlReply:
        """A corrupt/truncated chunk: free the destination's blocks, then move by tokens."""
        log.warning("KV migration falls back to token mode", request_id=self.rid, destination=self.msg.destination,
                    error=why)
        try:
            await self._ctl(MigrateKvCancel(idempotency_key=f"kv-cancel-{self.rid}-{self.nonce}"[:128],
                                            request_id=self.rid, source=self.worker.worker_id, reason=why[:2000]),
                            timeout=max(CTL_TIMEOUT_S, 35.0))
        except (TidalError, OSError, _Refused) as exc:
            return await self._stay(f"{why}; then the destination did not release its blocks: {exc!r}")
        if self.stopped is None:
            return await move_by_tokens(self.worker, self.msg, self.entry, self.started, fallback=why)
        stopped = self.stopped
        d = stopped.detached
        a = self.entry.assignment
        moved = msgspec.structs.replace(
            a, idempotency_key=f"{self.rid}:migrate:{self.nonce}"[:128], instance_id=self.msg.destination_instance,
            resume_token_ids=d.output_token_ids, next_seq=stopped.next_seq, kv_computed_tokens=0,
            handover=a.handover + 1,
        )
        failed = await hand_over(self.worker, self.msg.destination, moved)
        if failed is not None:
            self.stopped, self.reserved = stopped, False
            return await self._stay(f"{why}; then the token hand-over failed: {failed}")
        resumed_at = time.monotonic()
        self.worker.active.pop(self.rid, None)
        await self.inst.release_kv(self.rid)
        report = MigrationReport(
            requested_mode="kv", mode="tokens", fallback=why[:2000], stages=self.stages, kv_bytes=self.kv_bytes,
            tokens=len(d.prompt_token_ids) + len(d.output_token_ids), downtime_s=resumed_at - stopped.stopped_at,
            total_s=resumed_at - self.started,
        )
        return CtlDone(idempotency_key=self.msg.idempotency_key, command="MigrateOut", worker_id=self.worker.worker_id,
                       detail=f"{self.rid} moved to {self.msg.destination} by tokens after {why}", migration=report)

    def _cancel_remote(self, why: str) -> None:
        """Best effort, in the background: a dead destination must not delay the reply."""
        if not self.reserved:
            return
        cmd = MigrateKvCancel(idempotency_key=f"kv-cancel-{self.rid}-{self.nonce}"[:128], request_id=self.rid,
                              source=self.worker.worker_id, reason=why[:2000])
        self.worker.spawn_task(self._ctl_quietly(cmd))

    async def _ctl_quietly(self, cmd: msgspec.Struct) -> None:
        try:
            await self.worker.bus.request(worker_migrate(self.msg.destination), cmd, CtlReply, timeout=35.0)
        except (TidalError, OSError) as exc:
            log.info("destination not told to release its KV reservation (it expires there)", request_id=self.rid,
                     error=repr(exc))

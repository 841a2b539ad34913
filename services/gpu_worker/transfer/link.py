"""The sending side of one link (this worker -> one peer): the transfer scheduler's I/O.

`LinkSchedule` (pure, `policy.py`) decides which chunk goes next, how big, and on which
lane; this class posts the frames and payloads on the lane's UCX endpoint (bulk, or the
express endpoint of activations), feeds completions back (bandwidth), and turns the
receiver's Ack/Nack into the completion of each transfer's handle.

Posting order is the wire order: every send is posted to UCX when `_post` is called (no
task in between), so a chunk's header always precedes its payload, and a transfer's Start
precedes its chunks. A transfer stays on one lane (one endpoint) from Start to Ack.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np

from shared.events.common import LayerRange
from shared.logging import get_logger

from . import metrics, timeline
from .buffers import Segments, checksum_algorithm, checksum_of, is_host, synchronize
from .channel import Channel
from .errors import FailureReason, TransferFailed
from .frames import (
    INLINE_MAX, MAX_FRAME, PREPOST, TAG_FRAME, TAG_INLINE, TAG_REPLY, ChunkHeader, Goodbye, Hello, InlineTransfer,
    TransferAbort, TransferAck, TransferStart, chunk_count, decode_reply_frame, encode_frame, encode_inline,
)
from .policy import ChunkingConfig, ChunkPlan, LinkSchedule, TrafficClass

log = get_logger(__name__)
MAX_SEGMENT_HINT = 256  # buffer sizes announced in TransferStart (a layout hint; it must fit one frame)
_EMPTY = np.empty(0, dtype=np.uint8)


@dataclass(frozen=True)
class TransferReceipt:
    transfer_id: int
    peer: str
    kind: TrafficClass
    total_bytes: int
    chunks: int
    seconds: float  # submit -> acknowledged
    waited_s: float  # submit -> first chunk on the wire
    chunks_ahead: int  # chunks of other transfers started between submit and its first chunk


class TransferHandle:
    """One submitted transfer: await it for its receipt; `cancel()` to drop its unsent chunks."""

    def __init__(self, link: "Link", transfer_id: int, kind: TrafficClass, key: str, total_bytes: int) -> None:
        self.link = link
        self.transfer_id = transfer_id
        self.kind = kind
        self.key = key
        self.total_bytes = total_bytes
        self.chunks_sent = 0  # completed chunk sends (the receiver may not have verified them yet)
        self.waited_s: float | None = None
        self.chunks_ahead: int | None = None
        self.submitted_at = link.clock()
        self._fut: asyncio.Future[TransferReceipt] = asyncio.get_running_loop().create_future()
        self._fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def done(self) -> bool:
        return self._fut.done()

    def cancel(self) -> bool:
        """Cancel; True if it was still running. Awaiting it then raises TransferFailed('cancelled')."""
        return self.link.cancel(self.transfer_id, "cancelled", "cancelled by the sender")

    async def wait(self, timeout: float | None = None) -> TransferReceipt:
        if timeout is None:
            return await asyncio.shield(self._fut)
        try:
            return await asyncio.wait_for(asyncio.shield(self._fut), timeout)
        except asyncio.TimeoutError:
            self.link.cancel(self.transfer_id, "timeout", f"not acknowledged within {timeout}s")
            return await asyncio.shield(self._fut)

    def __await__(self) -> Any:
        return self.wait().__await__()

    def _settle(self, receipt: TransferReceipt | None, error: TransferFailed | None) -> None:
        if self._fut.done():
            return
        if error is not None:
            self._fut.set_exception(error)
        else:
            self._fut.set_result(receipt)  # type: ignore[arg-type]


@dataclass
class _Outgoing:
    handle: TransferHandle
    segments: Segments
    start: TransferStart
    started: bool = False
    all_posted: bool = False
    chunks_posted: int = 0
    n_chunks: int = 0
    data_tag: Any = None
    channel: Channel | None = None  # the lane's endpoint, from its first chunk on
    inline: bool = False  # sent whole in one message (express lane): no receives to close on cancel


class Link:
    """Sender side of this worker's endpoint to `peer`. Create with `DataPlane.link(peer)`."""

    _ids = itertools.count(1)

    def __init__(self, local_id: str, peer: str, endpoint: Any, cfg: ChunkingConfig, *, express_endpoint: Any = None,
                 checksums: bool = True, on_dead: Callable[["Link"], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.local_id, self.peer, self.clock = local_id, peer, clock
        self.checksums = checksums
        self.channel = Channel(endpoint)  # bulk lane (and everything, without an express endpoint)
        self.express = Channel(express_endpoint) if express_endpoint is not None else None
        if self.express is None and cfg.express_activations:
            cfg = dataclasses.replace(cfg, express_activations=False)
        self.schedule = LinkSchedule(cfg)
        self.sent_log: deque[tuple[int, int, int]] = deque(maxlen=100_000)  # (transfer, chunk, length) in post order
        self.backpressure_waits = 0
        self._on_dead = on_dead
        self._out: dict[int, _Outgoing] = {}
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._dead: TransferFailed | None = None
        self._posted_sends: set[asyncio.Future[Any]] = set()
        self._pump_task: asyncio.Task[None] | None = None
        self._reply_tasks: list[asyncio.Task[None]] = []

    @property
    def alive(self) -> bool:
        return self._dead is None

    def _lanes(self) -> list[tuple[str, Channel]]:
        return [("bulk", self.channel)] + ([("express", self.express)] if self.express is not None else [])

    async def start(self) -> "Link":
        for lane, channel in self._lanes():
            self._post(encode_frame(Hello(worker_id=self.local_id, lane=lane)), TAG_FRAME, channel)
            self._reply_tasks.append(asyncio.create_task(self._replies(channel), name=f"transfer-replies-{self.peer}-{lane}"))
        self._pump_task = asyncio.create_task(self._pump(), name=f"transfer-pump-{self.peer}")
        return self

    # --- API ---------------------------------------------------------------------------
    async def submit(self, buffers: Any, *, kind: TrafficClass, key: str = "", layers: LayerRange | None = None,
                     request_id: str = "") -> TransferHandle:
        """Queue `buffers` (a tensor/array/bytes, or a list of them: one byte stream) for `peer`.

        Waits while the class's queued bytes are over the bound (backpressure). The buffers
        must stay untouched until the handle completes: chunks are sent from their memory."""
        segments = Segments.of(buffers)
        synchronize(segments.views)  # device memory: the kernels that wrote it are done before UCX reads it
        while self._dead is None and not self.schedule.can_admit(kind, segments.total):
            self.backpressure_waits += 1
            metrics.BACKPRESSURE_WAITS.labels(self.peer, kind.name.lower()).inc()
            await self._space.wait()
        if self._dead is not None:
            raise TransferFailed(self._dead.reason, str(self._dead), peer=self.peer)
        tid = next(self._ids)
        handle = TransferHandle(self, tid, kind, key, segments.total)
        start = TransferStart(  # chunk_bytes is set when the first chunk goes
            transfer_id=tid, kind=kind.name.lower(), key=key, total_bytes=segments.total, chunk_bytes=1,
            segments=segments.sizes if len(segments.sizes) <= MAX_SEGMENT_HINT else [], layers=layers,
            request_id=request_id, checksum=checksum_algorithm(segments.views) if self.checksums else "none",
        )
        self._out[tid] = _Outgoing(handle, segments, start)
        self.schedule.add(tid, kind, segments.total, self.clock())
        if timeline.EVENTS is not None:
            timeline.mark("submit", tid)
        self._update_gauges()
        self._wake.set()
        return handle

    async def send(self, buffers: Any, *, kind: TrafficClass, key: str = "", timeout: float | None = None,
                   **meta: Any) -> TransferReceipt:
        handle = await self.submit(buffers, kind=kind, key=key, **meta)
        return await handle.wait(timeout)

    def cancel(self, tid: int, reason: FailureReason, message: str) -> bool:
        out = self._out.pop(tid, None)
        if out is None:
            return False
        self.schedule.cancel(tid)
        if out.started and out.channel is not None and not out.inline and self._dead is None:  # close it there too
            fillers = min(PREPOST, out.n_chunks - out.chunks_posted)
            self._post(encode_frame(TransferAbort(transfer_id=tid, reason=reason, message=message[:2000],
                                                  chunks_posted=out.chunks_posted, fillers=fillers)), TAG_FRAME, out.channel)
            for _ in range(fillers):  # complete the receives it may have pre-posted
                self._post(_EMPTY, out.data_tag, out.channel)
        self._finish(out, error=TransferFailed(reason, message, transfer_id=tid, peer=self.peer))
        self._signal_space()
        self._wake.set()
        return True

    async def close(self, reason: FailureReason = "closed") -> None:
        self._die(TransferFailed(reason, "link closed", peer=self.peer), closed_by="us")
        mine = [t for t in (self._pump_task, *self._reply_tasks) if t is not None and t is not asyncio.current_task()]
        for task in mine:
            task.cancel()
        await asyncio.gather(*mine, return_exceptions=True)
        for _lane, channel in self._lanes():
            try:
                await asyncio.wait_for(channel.close(), 2.0)
            except Exception:  # noqa: BLE001 - a dead peer's endpoint may fail to close; nothing to do
                channel.abort()

    # --- sending -----------------------------------------------------------------------
    async def _pump(self) -> None:
        while self._dead is None:
            now = self.clock()
            plan = self.schedule.next_chunk(now)
            if plan is None:
                self._wake.clear()
                expires = self.schedule.hold_expires_at()  # bulk held for an activation: look again then
                try:
                    await asyncio.wait_for(self._wake.wait(), None if expires is None else max(0.0, expires - now))
                except asyncio.TimeoutError:
                    pass
                continue
            try:
                self._post_chunk(plan)
            except Exception as exc:  # noqa: BLE001 - a bug or bad buffer fails that transfer, not the link
                log.exception("could not post a chunk", peer=self.peer, transfer_id=plan.tid)
                self.schedule.chunk_failed(express=plan.express)
                self.cancel(plan.tid, "protocol", f"could not post chunk {plan.index}: {exc!r}")
            self._signal_space()

    def _post_chunk(self, plan: ChunkPlan) -> None:
        out = self._out[plan.tid]
        cls = plan.cls.name.lower()
        if plan.index == 0:
            out.started = True
            out.channel = self.express if plan.express and self.express is not None else self.channel
            out.handle.waited_s, out.handle.chunks_ahead = plan.waited_s, plan.chunks_ahead
            metrics.WAIT_SECONDS.labels(self.peer, cls).observe(plan.waited_s or 0.0)
            out.start = msgspec.structs.replace(out.start, chunk_bytes=plan.chunk_size)
            out.n_chunks = chunk_count(out.start.total_bytes, plan.chunk_size)
            out.inline = plan.express and plan.last and plan.length <= INLINE_MAX \
                and all(is_host(v) for v in out.segments.views)  # device memory: no host copy
            if not out.inline:  # an inline transfer's Start travels in its one message
                out.data_tag = out.channel.data_tags(plan.tid)[0]
                self._post(encode_frame(out.start), TAG_FRAME, out.channel)
        channel = out.channel
        assert channel is not None
        payload = out.segments.gather(plan.offset, plan.length)
        checksum = checksum_of(payload, out.start.checksum)
        if out.inline:
            sent = self._post(encode_inline(InlineTransfer(start=out.start, checksum=checksum), payload), TAG_INLINE,
                              channel)
        else:
            header = ChunkHeader(transfer_id=plan.tid, index=plan.index, offset=plan.offset, length=plan.length,
                                 checksum=checksum, last=plan.last)
            self._post(encode_frame(header), TAG_FRAME, channel)
            sent = self._post(payload, out.data_tag, channel)
        if timeline.EVENTS is not None:
            timeline.mark("post", plan.tid, plan.index)
        out.chunks_posted += 1
        sent.add_done_callback(lambda f: self._chunk_sent(plan, f))
        self.sent_log.append((plan.tid, plan.index, plan.length))
        if plan.last:
            out.all_posted = True
        self._update_gauges()

    def _chunk_sent(self, plan: ChunkPlan, sent: "asyncio.Future[Any]") -> None:
        if sent.cancelled() or sent.exception() is not None:
            self.schedule.chunk_failed(express=plan.express)
            return  # _post's callback kills the link
        self.schedule.chunk_done(plan.length, self.clock(), express=plan.express)
        if timeline.EVENTS is not None:
            timeline.mark("sent", plan.tid, plan.index)
        out = self._out.get(plan.tid)
        if out is not None:
            out.handle.chunks_sent += 1
        metrics.BYTES.labels(self.peer, plan.cls.name.lower(), "sent").inc(plan.length)
        metrics.CHUNKS.labels(self.peer, "sent").inc()
        metrics.BANDWIDTH.labels(self.peer).set(self.schedule.bandwidth.value)
        metrics.CHUNK_BYTES.labels(self.peer).set(self.schedule.chunk_limit(TrafficClass.KV))
        self._wake.set()

    def _post(self, buf: Any, tag: Any, channel: Channel) -> "asyncio.Future[Any]":
        """Post a send now (wire order = call order, per lane); a failure kills the link."""
        try:
            sent = channel.send(buf, tag) if isinstance(tag, int) else channel.send_tagged(buf, tag)
        except Exception as exc:  # noqa: BLE001 - the endpoint is already broken
            sent = asyncio.get_running_loop().create_future()
            sent.set_exception(exc)
        self._posted_sends.add(sent)
        sent.add_done_callback(self._posted)
        return sent

    def _posted(self, sent: "asyncio.Future[Any]") -> None:
        self._posted_sends.discard(sent)
        if not sent.cancelled() and sent.exception() is not None and self._dead is None:
            self._die(TransferFailed("peer_lost", f"send failed: {sent.exception()}", peer=self.peer))

    # --- replies -----------------------------------------------------------------------
    async def _replies(self, channel: Channel) -> None:
        buf = np.empty(MAX_FRAME, dtype=np.uint8)
        try:
            while self._dead is None:
                await channel.recv(buf, TAG_REPLY)
                self._on_reply(decode_reply_frame(memoryview(buf)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any endpoint error means the peer is gone
            self._die(TransferFailed("peer_lost", f"connection to {self.peer} broke: {exc}", peer=self.peer))

    def _on_reply(self, frame: Any) -> None:
        if isinstance(frame, Goodbye):  # the peer's data plane shuts down: an orderly end, not a failure
            self._die(TransferFailed("peer_lost", f"the peer closed the link ({frame.reason})", peer=self.peer),
                      closed_by="peer")
            return
        if timeline.EVENTS is not None:
            timeline.mark("ack", frame.transfer_id)
        out = self._out.get(frame.transfer_id)
        if out is None:
            return  # cancelled here already; the receiver's answer crossed our Abort
        if isinstance(frame, TransferAck):
            del self._out[frame.transfer_id]
            h = out.handle
            self._finish(out, receipt=TransferReceipt(
                transfer_id=h.transfer_id, peer=self.peer, kind=h.kind, total_bytes=h.total_bytes, chunks=frame.chunks,
                seconds=self.clock() - h.submitted_at, waited_s=h.waited_s or 0.0, chunks_ahead=h.chunks_ahead or 0,
            ))
        else:
            self.cancel(frame.transfer_id, frame.reason, f"receiver refused: {frame.message}")

    # --- endings -----------------------------------------------------------------------
    def _finish(self, out: _Outgoing, *, receipt: TransferReceipt | None = None,
                error: TransferFailed | None = None) -> None:
        cls = out.handle.kind.name.lower()
        self.schedule.transfer_ended(out.handle.transfer_id)
        self._wake.set()  # bulk held back for it may go now
        if error is not None:
            metrics.FAILURES.labels(self.peer, error.reason, "sent").inc()
        else:
            metrics.TRANSFER_SECONDS.labels(self.peer, cls).observe(receipt.seconds)  # type: ignore[union-attr]
        out.handle._settle(receipt, error)
        self._update_gauges()

    def _die(self, error: TransferFailed, *, closed_by: str | None = None) -> None:
        """End the link: every transfer on it fails with `error`. An orderly close — ours (`closed_by`
        "us") or the peer's Goodbye ("peer") — is logged at info; anything else is a failure (a warning)."""
        if self._dead is not None:
            return
        self._dead = error
        if closed_by is not None:
            log.info("data-plane link closed", peer=self.peer, by=closed_by, pending=len(self._out))
        else:
            log.warning("data-plane link down", peer=self.peer, reason=error.reason, error=str(error))
        for tid, out in list(self._out.items()):
            self._out.pop(tid)
            self.schedule.cancel(tid)
            self._finish(out, error=TransferFailed(error.reason, str(error), transfer_id=tid, peer=self.peer))
        self._signal_space()
        self._wake.set()
        if self._on_dead is not None:
            self._on_dead(self)

    def _signal_space(self) -> None:
        """Wake submitters waiting for queue space (they re-check the bound)."""
        self._space.set()
        self._space = asyncio.Event()

    def _update_gauges(self) -> None:
        for cls in TrafficClass:
            name = cls.name.lower()
            metrics.QUEUE_DEPTH.labels(self.peer, name).set(sum(1 for o in self._out.values() if o.handle.kind is cls))
            metrics.QUEUED_BYTES.labels(self.peer, name).set(self.schedule.queued_bytes(cls))

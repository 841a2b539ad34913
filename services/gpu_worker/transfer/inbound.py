"""The receiving side of one endpoint a peer opened to us.

On `TransferStart` it learns the transfer's chunk layout and pre-posts receives for its
first `PREPOST` chunks straight into the destination (the Sink's memory; a staging buffer
only for a chunk that spans several destination segments), then keeps `PREPOST` posted
ahead of the chunk headers it has read. A chunk is verified when both its payload and its
header are in; the transfer is answered once: `Ack` when every chunk is intact, `Nack`
at the first problem.

The destination is handed back to its owner (the Sink completes or fails) only when no
receive into it is still posted: after a failure, the sender's Abort and fillers (see
frames.py) complete the outstanding receives first, and a lost connection cancels them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from shared.logging import get_logger

from . import metrics, timeline
from .buffers import ByteView, checksum_of, empty_like_device
from .channel import Channel
from .express import InlineReceiver
from .errors import FailureReason, TransferFailed
from .frames import (
    MAX_FRAME, PREPOST, TAG_FRAME, TAG_REPLY, ChunkHeader, Goodbye, Hello, TransferAbort, TransferAck, TransferNack,
    TransferStart, chunk_count, decode_sender_frame, encode_frame,
)
from .policy import TrafficClass
from .sink import Inbox, Received, Sink

log = get_logger(__name__)

ChunkHook = Callable[[ChunkHeader, ByteView], None]  # fault injection: sees each payload before verification
GOODBYE_TIMEOUT_S = 1.0  # an orderly close waits this long at most for its Goodbye to go out


@dataclass
class _Rx:
    start: TransferStart
    sink: Sink | None  # None: refused
    tag: Any
    n_chunks: int
    posted: int = 0  # receives posted, for chunks [0, posted)
    outstanding: int = 0  # of those, not yet completed
    headers_seen: int = 0
    verified: int = 0
    headers: dict[int, ChunkHeader] = field(default_factory=dict)  # header in, payload not yet
    landed: dict[int, tuple[ByteView, bool]] = field(default_factory=dict)  # payload in, header not yet
    failed: TransferFailed | None = None
    closed_by_sender: bool = False

    def span(self, index: int) -> tuple[int, int]:
        offset = index * self.start.chunk_bytes
        return offset, max(0, min(self.start.chunk_bytes, self.start.total_bytes - offset))


class InboundConnection:
    def __init__(self, endpoint: Any, inbox: Inbox, *, chunk_hook: ChunkHook | None = None) -> None:
        self.channel = Channel(endpoint)
        self.inbox = inbox
        self.peer = "unknown"
        self.lane = "bulk"  # which lane of the peer's link this endpoint is (Hello)
        self.chunk_hook = chunk_hook
        self._rx: dict[int, _Rx] = {}
        self._inline: InlineReceiver | None = None  # express lane: inline transfers (activations)

    async def run(self) -> None:
        buf = np.empty(MAX_FRAME, dtype=np.uint8)
        reason: FailureReason = "peer_lost"
        try:
            while True:
                await self.channel.recv(buf, TAG_FRAME)
                try:
                    frame = decode_sender_frame(memoryview(buf))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    reason = "protocol"  # the stream can no longer be trusted: drop the connection
                    log.warning("malformed data-plane frame; closing the connection", peer=self.peer, error=str(exc))
                    return
                self._on_frame(frame)
        except asyncio.CancelledError:
            reason = "closed"
            raise
        except Exception as exc:  # noqa: BLE001 - endpoint errors: the peer went away
            log.info("data-plane peer disconnected", peer=self.peer, error=str(exc))
        finally:
            if reason == "closed":  # our plane shuts down: tell the sender it is no failure
                await self._goodbye()
            if self._inline is not None:
                self._inline.close()
            for rx in list(self._rx.values()):
                self._fail(rx, reason, "connection closed before the transfer completed", reply=False)
                rx.closed_by_sender = True  # nothing more will come; the posted receives get cancelled
            try:
                self.channel.abort()  # cancels posted receives; UCX cannot be reset while endpoints live
            except Exception:  # noqa: BLE001 - already torn down by the peer's disconnect
                pass
            for rx in list(self._rx.values()):
                self._maybe_close(rx, force=True)

    async def _goodbye(self) -> None:
        try:
            await asyncio.wait_for(self.channel.send(encode_frame(Goodbye(reason="shutting down")), TAG_REPLY),
                                   GOODBYE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the peer is gone already; it sees a lost connection
            pass

    def _inline_broken(self, why: str) -> None:
        log.warning("express lane broken; closing the connection", peer=self.peer, error=why)
        try:
            self.channel.abort()  # the frame loop fails on it and fails every transfer of the connection
        except Exception:  # noqa: BLE001 - already torn down
            pass

    def _on_frame(self, frame: Any) -> None:
        if isinstance(frame, ChunkHeader):
            self._on_header(frame)
        elif isinstance(frame, TransferStart):
            self._on_start(frame)
        elif isinstance(frame, TransferAbort):
            self._on_abort(frame)
        elif isinstance(frame, Hello):
            self.peer, self.lane = frame.worker_id, frame.lane
            if frame.lane == "express" and self._inline is None:
                self._inline = InlineReceiver(self.channel, self.inbox, self.peer, self._reply,
                                              chunk_hook=self.chunk_hook, on_broken=self._inline_broken)
                self._inline.start()

    # --- frames ------------------------------------------------------------------------
    def _on_start(self, start: TransferStart) -> None:
        tid = start.transfer_id
        if timeline.EVENTS is not None:
            timeline.mark("start", tid)
        rx = _Rx(start, self.inbox.open(start, self.peer), self.channel.data_tags(tid)[1],
                 chunk_count(start.total_bytes, start.chunk_bytes))
        self._rx[tid] = rx
        if rx.sink is None:
            self._fail(rx, "rejected", f"nothing expects key {start.key!r} ({start.kind})")
        elif rx.sink.segments.total != start.total_bytes:
            self._fail(rx, "rejected",
                       f"destination for {start.key!r} holds {rx.sink.segments.total} bytes, transfer has {start.total_bytes}")
        self._post_up_to(rx, min(rx.n_chunks, PREPOST))

    def _on_header(self, h: ChunkHeader) -> None:
        if timeline.EVENTS is not None:
            timeline.mark("header", h.transfer_id, h.index)
        rx = self._rx.get(h.transfer_id)
        if rx is None:
            return  # a transfer that already ended here; its payload receive was posted before
        if (h.index, (h.offset, h.length)) != (rx.headers_seen, rx.span(rx.headers_seen)) or h.index >= rx.n_chunks:
            self._fail(rx, "protocol", f"chunk {h.index} at {h.offset}+{h.length} does not fit the announced layout")
        rx.headers_seen += 1
        self._post_up_to(rx, min(rx.n_chunks, rx.headers_seen + PREPOST))
        if h.index in rx.landed:
            dest, staged = rx.landed.pop(h.index)
            self._verify(rx, h, dest, staged)
        else:
            rx.headers[h.index] = h

    def _on_abort(self, frame: TransferAbort) -> None:
        rx = self._rx.get(frame.transfer_id)
        if rx is None:
            return
        rx.closed_by_sender = True
        self._fail(rx, frame.reason, frame.message or "aborted by the sender", reply=False)
        self._post_up_to(rx, min(rx.n_chunks, frame.chunks_posted + frame.fillers))  # so every filler is consumed
        self._maybe_close(rx)

    # --- payloads ----------------------------------------------------------------------
    def _post_up_to(self, rx: _Rx, limit: int) -> None:
        while rx.posted < limit:
            index = rx.posted
            offset, length = rx.span(index)
            dest, staged = self._destination(rx, offset, length)
            try:
                received = self.channel.recv_tagged(dest, rx.tag)
            except Exception as exc:  # noqa: BLE001 - the endpoint broke; the frame loop ends too
                self._fail(rx, "peer_lost", f"cannot post a receive: {exc}", reply=False)
                return
            rx.posted += 1
            rx.outstanding += 1
            received.add_done_callback(lambda f, i=index, d=dest, s=staged: self._landed(rx, i, d, s, f))

    def _destination(self, rx: _Rx, offset: int, length: int) -> tuple[ByteView, bool]:
        if rx.failed is not None or rx.sink is None:
            return np.empty(length, dtype=np.uint8), False  # drained and dropped
        parts = rx.sink.segments.pieces(offset, length)
        if len(parts) == 1:
            return parts[0], False  # zero copy: straight into the destination
        template = parts[0] if parts else np.empty(0, dtype=np.uint8)
        return empty_like_device(template, length), True

    def _landed(self, rx: _Rx, index: int, dest: ByteView, staged: bool, f: "asyncio.Future[Any]") -> None:
        rx.outstanding -= 1
        if timeline.EVENTS is not None:
            timeline.mark("landed", rx.start.transfer_id, index)
        error = None if f.cancelled() else f.exception()
        if f.cancelled() or error is not None:
            truncated = type(error).__name__ == "UCXXMessageTruncatedError"
            self._fail(rx, "truncated" if truncated else "peer_lost",
                       f"chunk {index}: {'longer than announced' if truncated else error or 'cancelled'}")
        elif rx.failed is None:
            header = rx.headers.pop(index, None)
            if header is None:
                rx.landed[index] = (dest, staged)
            else:
                self._verify(rx, header, dest, staged)
        self._maybe_close(rx)

    def _verify(self, rx: _Rx, h: ChunkHeader, dest: ByteView, staged: bool) -> None:
        if rx.failed is not None:
            return
        if self.chunk_hook is not None:
            self.chunk_hook(h, dest)
        if checksum_of(dest, rx.start.checksum) != h.checksum:
            self._fail(rx, "corrupt", f"chunk {h.index} ({h.length} bytes at {h.offset}): checksum mismatch")
            return
        if staged:
            rx.sink.segments.scatter(h.offset, dest)  # type: ignore[union-attr]
        rx.verified += 1
        if timeline.EVENTS is not None:
            timeline.mark("verified", h.transfer_id, h.index)
        metrics.BYTES.labels(self.peer, rx.start.kind, "received").inc(h.length)
        metrics.CHUNKS.labels(self.peer, "received").inc()
        if rx.verified == rx.n_chunks:
            s = rx.start
            self._reply(TransferAck(transfer_id=s.transfer_id, chunks=rx.n_chunks, total_bytes=s.total_bytes))
            if timeline.EVENTS is not None:
                timeline.mark("ack_sent", s.transfer_id)
            rx.closed_by_sender = True
            self._maybe_close(rx)

    # --- endings -----------------------------------------------------------------------
    def _fail(self, rx: _Rx, reason: FailureReason, message: str, *, reply: bool = True) -> None:
        if rx.failed is not None:
            return
        tid = rx.start.transfer_id
        rx.failed = TransferFailed(reason, message, transfer_id=tid, peer=self.peer)
        metrics.FAILURES.labels(self.peer, reason, "received").inc()
        log.warning("incoming transfer failed", peer=self.peer, transfer_id=tid, key=rx.start.key, reason=reason,
                    error=message)
        if reply:
            self._reply(TransferNack(transfer_id=tid, reason=reason, message=message[:2000]))

    def _maybe_close(self, rx: _Rx, *, force: bool = False) -> None:
        """Hand the destination back once nothing more will be written into it."""
        if not force and (rx.outstanding or not rx.closed_by_sender):
            return
        if self._rx.pop(rx.start.transfer_id, None) is None or rx.sink is None:
            return
        if rx.failed is not None:
            rx.sink.fail(rx.failed)
            return
        s = rx.start
        layers = (s.layers.start, s.layers.end) if s.layers is not None else None
        rx.sink.complete(Received(
            key=s.key, kind=TrafficClass[s.kind.upper()], peer=self.peer, transfer_id=s.transfer_id,
            total_bytes=s.total_bytes, chunks=rx.n_chunks, buffers=rx.sink.buffers, layers=layers,
            request_id=s.request_id,
        ))

    def _reply(self, frame: TransferAck | TransferNack) -> None:
        try:
            self.channel.send(encode_frame(frame), TAG_REPLY)  # a failure shows in the frame loop too
        except Exception as exc:  # noqa: BLE001
            log.info("could not answer a transfer; the peer is gone", peer=self.peer, error=str(exc))

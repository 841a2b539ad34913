"""The receiving side of one endpoint a peer opened to us.

Reads frames in order; for each chunk header it posts the payload receive straight into the
destination memory (the Sink's segment; a staging buffer only when a chunk spans several
segments), verifies the checksum when it lands, and answers each transfer once: `Ack` when
every chunk arrived intact, `Nack(reason)` at the first problem. Chunks of a transfer that
failed or was refused are still received (into scratch memory) and dropped, so the stream
stays aligned for the transfers behind it.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np

from shared.logging import get_logger

from . import metrics
from .buffers import ByteView, checksum_of, empty_like_device
from .errors import FailureReason, TransferFailed
from .frames import (
    MAX_FRAME, TAG_DATA, TAG_FRAME, TAG_REPLY, ChunkHeader, Hello, TransferAbort, TransferAck, TransferNack,
    TransferStart, decode_sender_frame, encode_frame,
)
from .policy import TrafficClass
from .sink import Inbox, Received, Sink

log = get_logger(__name__)

ChunkHook = Callable[[ChunkHeader, ByteView], None]  # fault injection: sees each payload before verification


@dataclass
class _Rx:
    start: TransferStart
    sink: Sink | None  # None: refused
    next_offset: int = 0
    next_index: int = 0
    pending: int = 0  # payload receives posted, not yet verified
    chunks: int = 0
    last_seen: bool = False
    failed: FailureReason | None = None


class InboundConnection:
    def __init__(self, endpoint: Any, inbox: Inbox, *, chunk_hook: ChunkHook | None = None,
                 max_outstanding: int = 4) -> None:
        self.endpoint = endpoint
        self.inbox = inbox
        self.peer = "unknown"
        self.chunk_hook = chunk_hook
        self._rx: dict[int, _Rx] = {}
        self._slots = asyncio.Semaphore(max_outstanding)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self) -> None:
        buf = np.empty(MAX_FRAME, dtype=np.uint8)
        reason: FailureReason = "peer_lost"
        try:
            while True:
                await self.endpoint.recv(buf, tag=TAG_FRAME)
                try:
                    frame = decode_sender_frame(memoryview(buf))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    reason = "protocol"  # the stream can no longer be trusted: drop the connection
                    log.warning("malformed data-plane frame; closing the connection", peer=self.peer, error=str(exc))
                    return
                await self._on_frame(frame)
        except asyncio.CancelledError:
            reason = "closed"
            raise
        except Exception as exc:  # noqa: BLE001 - endpoint errors: the peer went away
            log.info("data-plane peer disconnected", peer=self.peer, error=str(exc))
        finally:
            for tid in list(self._rx):
                self._fail(tid, reason, "connection closed before the transfer completed", reply=False)
            for task in list(self._tasks):
                task.cancel()
            try:
                self.endpoint.abort()  # release it (UCX cannot be reset while endpoints live)
            except Exception:  # noqa: BLE001 - already torn down by the peer's disconnect
                pass

    async def _on_frame(self, frame: Any) -> None:
        if isinstance(frame, ChunkHeader):
            await self._on_chunk(frame)
        elif isinstance(frame, TransferStart):
            self._on_start(frame)
        elif isinstance(frame, TransferAbort):
            rx = self._rx.pop(frame.transfer_id, None)
            if rx is not None and rx.sink is not None:
                rx.sink.fail(TransferFailed(frame.reason, frame.message or "aborted by the sender",
                                            transfer_id=frame.transfer_id, peer=self.peer))
        elif isinstance(frame, Hello):
            self.peer = frame.worker_id

    def _on_start(self, start: TransferStart) -> None:
        sink = self.inbox.open(start, self.peer)
        rx = _Rx(start, sink)
        self._rx[start.transfer_id] = rx
        if sink is None:
            self._fail(start.transfer_id, "rejected", f"nothing expects key {start.key!r} ({start.kind})")
        elif sink.segments.total != start.total_bytes:
            self._fail(start.transfer_id, "rejected",
                       f"destination for {start.key!r} holds {sink.segments.total} bytes, transfer has {start.total_bytes}")

    async def _on_chunk(self, h: ChunkHeader) -> None:
        rx = self._rx.get(h.transfer_id)
        if rx is None:  # e.g. Abort crossed our Nack; still consume the payload
            await self._post_recv(None, h, np.empty(h.length, dtype=np.uint8), None)
            return
        if rx.failed is None and (h.offset != rx.next_offset or h.index != rx.next_index
                                  or h.offset + h.length > rx.start.total_bytes):
            self._fail(h.transfer_id, "protocol", f"chunk {h.index} at {h.offset}+{h.length} out of order")
        rx.next_offset, rx.next_index = h.offset + h.length, h.index + 1
        rx.last_seen = h.last
        dest, staged = self._destination(rx, h)
        rx.pending += 1
        await self._post_recv(rx, h, dest, staged)

    def _destination(self, rx: _Rx, h: ChunkHeader) -> tuple[ByteView, bool]:
        if rx.failed is not None or rx.sink is None:
            return np.empty(h.length, dtype=np.uint8), False
        parts = rx.sink.segments.pieces(h.offset, h.length)
        if len(parts) == 1:
            return parts[0], False  # zero copy: straight into the destination
        template = parts[0] if parts else np.empty(0, dtype=np.uint8)
        return empty_like_device(template, h.length), True

    async def _post_recv(self, rx: _Rx | None, h: ChunkHeader, dest: ByteView, staged: bool | None) -> None:
        await self._slots.acquire()
        task = asyncio.ensure_future(self._receive(rx, h, dest, bool(staged)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _receive(self, rx: _Rx | None, h: ChunkHeader, dest: ByteView, staged: bool) -> None:
        try:
            try:
                await self.endpoint.recv(dest, tag=TAG_DATA)
            except Exception as exc:  # noqa: BLE001
                if type(exc).__name__ == "UCXXMessageTruncatedError" and rx is not None:
                    self._fail(h.transfer_id, "truncated", f"chunk {h.index} is longer than its {h.length} bytes")
                    return
                raise
        finally:
            self._slots.release()
        if rx is None:
            return
        rx.pending -= 1
        if self.chunk_hook is not None:
            self.chunk_hook(h, dest)
        if rx.failed is None:
            if checksum_of(dest, rx.start.checksum) != h.checksum:
                self._fail(h.transfer_id, "corrupt", f"chunk {h.index} ({h.length} bytes at {h.offset}): checksum mismatch")
            else:
                if staged:
                    rx.sink.segments.scatter(h.offset, dest)  # type: ignore[union-attr]
                rx.chunks += 1
                metrics.BYTES.labels(self.peer, rx.start.kind, "received").inc(h.length)
                metrics.CHUNKS.labels(self.peer, "received").inc()
        if rx.last_seen and rx.pending == 0:
            self._settle(h.transfer_id, rx)

    def _settle(self, tid: int, rx: _Rx) -> None:
        self._rx.pop(tid, None)
        if rx.failed is not None or rx.sink is None:
            return
        s = rx.start
        layers = (s.layers.start, s.layers.end) if s.layers is not None else None
        rx.sink.complete(Received(
            key=s.key, kind=TrafficClass[s.kind.upper()], peer=self.peer, transfer_id=tid, total_bytes=s.total_bytes,
            chunks=rx.chunks, buffers=rx.sink.buffers, layers=layers, request_id=s.request_id,
        ))
        self._reply(TransferAck(transfer_id=tid, chunks=rx.chunks, total_bytes=s.total_bytes))

    def _fail(self, tid: int, reason: FailureReason, message: str, *, reply: bool = True) -> None:
        rx = self._rx.get(tid)
        if rx is None or rx.failed is not None:
            return
        rx.failed = reason
        metrics.FAILURES.labels(self.peer, reason, "received").inc()
        log.warning("incoming transfer failed", peer=self.peer, transfer_id=tid, key=rx.start.key, reason=reason,
                    error=message)
        if rx.sink is not None:
            rx.sink.fail(TransferFailed(reason, message, transfer_id=tid, peer=self.peer))
        if reply:
            self._reply(TransferNack(transfer_id=tid, reason=reason, message=message[:2000]))
        if rx.last_seen and rx.pending == 0:
            self._rx.pop(tid, None)

    def _reply(self, frame: TransferAck | TransferNack) -> None:
        task = asyncio.ensure_future(self.endpoint.send(encode_frame(frame), tag=TAG_REPLY))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._tasks.discard(t) or t.cancelled() or t.exception())

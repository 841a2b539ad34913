"""The express lane's receiving side: inline transfers (activations) into receives posted ahead.

A transfer of at most `INLINE_MAX` bytes on a link's express endpoint travels as ONE message
(`InlineTransfer` frame + payload, frames.py). This side keeps `INLINE_RING` receives of
that size posted on the endpoint, so the message is matched — and its rendezvous run — by
UCX's progress thread as soon as it arrives. Without them the payload's receive could only
be posted after the event loop had read the transfer's Start frame: one more round of
thread hand-offs (progress thread -> notifier -> event loop -> progress thread) on the
activation's critical path, each a wait for a core on a busy host.

Each message is verified (checksum), copied into the destination the Inbox names (an
activation is small: one memcpy) and answered like any transfer (Ack / Nack on TAG_REPLY);
its receive buffer is posted again at once.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import msgspec
import numpy as np

from shared.logging import get_logger

from . import metrics, timeline
from .buffers import checksum_of
from .channel import Channel
from .errors import FailureReason, TransferFailed
from .frames import (
    INLINE_MAX, INLINE_RING, MAX_FRAME, TAG_INLINE, ChunkHeader, InlineTransfer, TransferAck, TransferNack,
    decode_inline,
)
from .policy import TrafficClass
from .sink import Inbox, Received

log = get_logger(__name__)

Reply = Callable[[TransferAck | TransferNack], None]
ChunkHook = Callable[[ChunkHeader, Any], None]


class InlineReceiver:
    """The posted ring of inline receives of one inbound express endpoint."""

    def __init__(self, channel: Channel, inbox: Inbox, peer: str, reply: Reply, *,
                 chunk_hook: ChunkHook | None = None, on_broken: Callable[[str], None] | None = None) -> None:
        self.channel, self.inbox, self.peer, self.reply = channel, inbox, peer, reply
        self.chunk_hook, self.on_broken = chunk_hook, on_broken
        self._closed = False

    def start(self) -> None:
        for _ in range(INLINE_RING):
            self._post(np.empty(INLINE_MAX + MAX_FRAME, dtype=np.uint8))

    def close(self) -> None:
        self._closed = True  # posted receives are cancelled with the endpoint

    def _post(self, buf: np.ndarray) -> None:
        if self._closed:
            return
        try:
            received = self.channel.recv(buf, TAG_INLINE)
        except Exception as exc:  # noqa: BLE001 - the endpoint broke; the frame loop ends too
            self._broken(f"cannot post an inline receive: {exc}")
            return
        received.add_done_callback(lambda f: self._landed(buf, f))

    def _broken(self, why: str) -> None:
        if not self._closed:
            self._closed = True
            if self.on_broken is not None:
                self.on_broken(why)

    def _landed(self, buf: np.ndarray, f: "asyncio.Future[Any]") -> None:
        if f.cancelled() or self._closed:
            return
        error = f.exception()
        if error is not None:
            if type(error).__name__ == "UCXXCanceledError":
                self._closed = True  # the endpoint is closing: the frame loop reports how it ended
            else:  # the connection broke, or a message over INLINE_MAX: the stream is unusable
                self._broken(f"inline receive failed: {error}")
            return
        try:
            frame, payload = decode_inline(buf)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._broken(f"malformed inline transfer: {exc}")
            return
        try:
            self._deliver(frame, payload)
        except Exception as exc:  # noqa: BLE001 - a bug or a bad destination fails that transfer, not the lane
            log.exception("could not deliver an inline transfer", peer=self.peer, transfer_id=frame.start.transfer_id)
            self._nack(frame.start.transfer_id, frame.start.key, "protocol", f"could not deliver it: {exc!r}")
        finally:
            self._post(buf)  # the payload was copied out (or dropped): the buffer takes the next one

    def _deliver(self, frame: InlineTransfer, payload: np.ndarray) -> None:
        start = frame.start
        tid = start.transfer_id
        if timeline.EVENTS is not None:
            for step in ("start", "landed"):
                timeline.mark(step, tid)
        sink = self.inbox.open(start, self.peer)
        if sink is None:
            self._nack(tid, start.key, "rejected", f"nothing expects key {start.key!r} ({start.kind})")
            return
        if sink.segments.total != start.total_bytes:
            error = self._nack(tid, start.key, "rejected", f"destination for {start.key!r} holds "
                               f"{sink.segments.total} bytes, transfer has {start.total_bytes}")
            sink.fail(error)
            return
        n = start.total_bytes
        if self.chunk_hook is not None:
            self.chunk_hook(ChunkHeader(transfer_id=tid, index=0, offset=0, length=n, checksum=frame.checksum,
                                        last=True), payload)
        if checksum_of(payload, start.checksum) != frame.checksum:
            sink.fail(self._nack(tid, start.key, "corrupt", f"inline transfer ({n} bytes): checksum mismatch"))
            return
        sink.segments.scatter(0, payload)
        if timeline.EVENTS is not None:
            timeline.mark("verified", tid)
        metrics.BYTES.labels(self.peer, start.kind, "received").inc(n)
        metrics.CHUNKS.labels(self.peer, "received").inc()
        self.reply(TransferAck(transfer_id=tid, chunks=1, total_bytes=n))
        layers = (start.layers.start, start.layers.end) if start.layers is not None else None
        sink.complete(Received(
            key=start.key, kind=TrafficClass[start.kind.upper()], peer=self.peer, transfer_id=tid, total_bytes=n,
            chunks=1, buffers=sink.buffers, layers=layers, request_id=start.request_id,
        ))

    def _nack(self, tid: int, key: str, reason: FailureReason, message: str) -> TransferFailed:
        metrics.FAILURES.labels(self.peer, reason, "received").inc()
        log.warning("incoming transfer failed", peer=self.peer, transfer_id=tid, key=key, reason=reason, error=message)
        self.reply(TransferNack(transfer_id=tid, reason=reason, message=message[:2000]))
        return TransferFailed(reason, message, transfer_id=tid, peer=self.peer)

"""The small typed frames that travel beside the payloads on a data-plane endpoint.

UCX tags per endpoint (tag matching keeps each tag's messages in posting order):

* `TAG_FRAME` sender -> receiver: `Hello`, `TransferStart`, `ChunkHeader`, `TransferAbort`;
* one data tag per transfer (`TAG_DATA` hashed with the transfer id) sender -> receiver: the
  raw payloads of its chunks, in order, received straight into the destination memory (no
  serialization). Chunks have a fixed size per transfer (`TransferStart.chunk_bytes`), so
  the receiver knows where chunk i lands and pre-posts up to `PREPOST` receives ahead of
  the chunk headers it has seen: the payload never waits for its header to be processed;
* `TAG_REPLY` receiver -> sender: `TransferAck`, `TransferNack`, and `Goodbye` as the last
  frame when the receiver closes the endpoint in order (its data plane shuts down), so the
  sender can tell an orderly close from a lost peer;
* `TAG_INLINE` sender -> receiver, on the express lane (a link's endpoint for activations):
  a whole transfer of at most `INLINE_MAX` bytes in ONE message — an `InlineTransfer`
  frame followed by the payload. The receiver keeps `INLINE_RING` receives of that size
  posted, so UCX matches the message (and runs its rendezvous) in its progress thread
  without waiting for the receiver's event loop to read a TransferStart first.

A transfer that ends early (cancelled, or refused by a Nack) is closed with a
`TransferAbort` that says how many payloads were posted and how many zero-length
*fillers* follow it: they complete every receive the receiver may have pre-posted, so none
stays pending (pinning memory, or writing into it later).

A frame is a 2-byte little-endian length and a msgpack-encoded `msgspec.Struct`; the
receiver posts a `MAX_FRAME`-byte buffer for it (UCX receives a shorter message into a
larger buffer, and reports none of its length: hence the prefix).
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np
from msgspec import Meta

from shared.events.base import MAX_BYTES, Message, Reason
from shared.events.common import LayerRange

from .errors import FailureReason

TAG_FRAME = 0x7444_0001
TAG_DATA = 0x7444_0002
TAG_REPLY = 0x7444_0003
TAG_INLINE = 0x7444_0004
MAX_FRAME = 4096  # bytes, length prefix included
PREPOST = 4  # receives a receiver may post beyond the chunk headers it has seen, per transfer
INLINE_MAX = 1 << 20  # payload bytes of an inline transfer (express lane)
INLINE_RING = 4  # inline receives an express endpoint keeps posted

TransferId = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_BYTES)]
KindName = Annotated[str, Meta(pattern=r"^(activation|kv|weights)$")]
Key = Annotated[str, Meta(max_length=256)]
PeerName = Annotated[str, Meta(min_length=1, max_length=64)]


class Hello(Message, kw_only=True):
    """First frame on a new endpoint: who is sending, and which of its link's lanes this is."""

    worker_id: PeerName
    protocol: Annotated[int, Meta(ge=1, le=1000)] = 1
    lane: Literal["bulk", "express"] = "bulk"  # express: the link's endpoint for activations


class TransferStart(Message, kw_only=True):
    """Announces a transfer; its chunks follow. `key` names the destination the receiver expects."""

    transfer_id: TransferId
    kind: KindName
    key: Key
    total_bytes: Bytes
    chunk_bytes: Annotated[int, Meta(ge=1, le=MAX_BYTES)]  # every chunk but the last is exactly this long
    segments: Annotated[list[Bytes], Meta(max_length=65_536)] = []  # sender's buffer sizes (a layout hint)
    layers: LayerRange | None = None
    request_id: Annotated[str, Meta(max_length=64)] = ""
    checksum: Annotated[str, Meta(pattern=r"^(xxh3_64|crc32|none)$")] = "xxh3_64"


class ChunkHeader(Message, kw_only=True):
    """Describes the next payload on TAG_DATA: bytes [offset, offset + length) of the transfer."""

    transfer_id: TransferId
    index: Annotated[int, Meta(ge=0, le=2**40)]
    offset: Bytes
    length: Bytes
    checksum: Annotated[int, Meta(ge=0)]  # unsigned 64-bit (msgpack uint64)
    last: bool = False


class TransferAbort(Message, kw_only=True):
    """The sender gave up on a transfer (cancelled, or answered a Nack); no more chunks follow.

    `chunks_posted` payloads were sent, then `fillers` zero-length messages on the same tag."""

    transfer_id: TransferId
    reason: FailureReason
    message: Reason = ""
    chunks_posted: Annotated[int, Meta(ge=0, le=2**40)] = 0
    fillers: Annotated[int, Meta(ge=0, le=PREPOST)] = 0


class InlineTransfer(Message, kw_only=True):
    """A whole transfer in one message: this frame, then `start.total_bytes` of payload."""

    start: TransferStart
    checksum: Annotated[int, Meta(ge=0)]  # of the whole payload (start.checksum's algorithm)


class TransferAck(Message, kw_only=True):
    """Every byte arrived, checksums matched, the destination holds the data."""

    transfer_id: TransferId
    chunks: Annotated[int, Meta(ge=0, le=2**40)]
    total_bytes: Bytes


class TransferNack(Message, kw_only=True):
    transfer_id: TransferId
    reason: FailureReason
    message: Reason = ""


class Goodbye(Message, kw_only=True):
    """The receiver closes this endpoint in order: nothing more will be answered on it."""

    reason: Reason = ""


SenderFrame = Hello | TransferStart | ChunkHeader | TransferAbort
ReplyFrame = TransferAck | TransferNack | Goodbye

_ENCODER = msgspec.msgpack.Encoder()
_SENDER_DECODER = msgspec.msgpack.Decoder(SenderFrame)
_REPLY_DECODER = msgspec.msgpack.Decoder(ReplyFrame)
_INLINE_DECODER = msgspec.msgpack.Decoder(InlineTransfer)


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    """Chunks of a transfer: an empty transfer still sends one (empty) chunk."""
    return max(1, -(-total_bytes // chunk_bytes))


def encode_frame(frame: SenderFrame | ReplyFrame | InlineTransfer) -> bytes:
    body = _ENCODER.encode(frame)
    if len(body) + 2 > MAX_FRAME:
        raise ValueError(f"frame {type(frame).__name__} is {len(body)} bytes, over {MAX_FRAME - 2}")
    return len(body).to_bytes(2, "little") + body


def _body(buf: memoryview) -> memoryview:
    n = int.from_bytes(buf[:2], "little")
    if n + 2 > len(buf):
        raise msgspec.DecodeError(f"frame length {n} exceeds the {len(buf)}-byte buffer")
    return buf[2:2 + n]


def decode_sender_frame(buf: memoryview) -> SenderFrame:
    """Raises msgspec.DecodeError / ValidationError on a malformed frame."""
    return _SENDER_DECODER.decode(_body(buf))


def decode_reply_frame(buf: memoryview) -> ReplyFrame:
    return _REPLY_DECODER.decode(_body(buf))


def encode_inline(frame: InlineTransfer, payload: np.ndarray) -> np.ndarray:
    """The one message of an inline transfer: the frame, then the payload (one copy of it)."""
    head = encode_frame(frame)
    if payload.shape[0] != frame.start.total_bytes or payload.shape[0] > INLINE_MAX:
        raise ValueError(f"inline payload of {payload.shape[0]} bytes (announced {frame.start.total_bytes}, "
                         f"at most {INLINE_MAX})")
    buf = np.empty(len(head) + payload.shape[0], dtype=np.uint8)
    buf[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    buf[len(head):] = payload
    return buf


def decode_inline(buf: np.ndarray) -> tuple[InlineTransfer, np.ndarray]:
    """(frame, view of its payload in `buf`); raises msgspec.DecodeError / ValidationError."""
    body = _body(memoryview(buf))
    frame = _INLINE_DECODER.decode(body)
    start = 2 + len(body)
    if start + frame.start.total_bytes > buf.shape[0]:
        raise msgspec.DecodeError(f"inline payload of {frame.start.total_bytes} bytes exceeds the receive buffer")
    return frame, buf[start:start + frame.start.total_bytes]

"""The small typed frames that travel beside the payloads on a data-plane endpoint.

UCX tags per endpoint (tag matching keeps each tag's messages in posting order):

* `TAG_FRAME` sender -> receiver: `Hello`, `TransferStart`, `ChunkHeader`, `TransferAbort`;
* one data tag per transfer (`TAG_DATA` hashed with the transfer id) sender -> receiver: the
  raw payloads of its chunks, in order, received straight into the destination memory (no
  serialization). Chunks have a fixed size per transfer (`TransferStart.chunk_bytes`), so
  the receiver knows where chunk i lands and pre-posts up to `PREPOST` receives ahead of
  the chunk headers it has seen: the payload never waits for its header to be processed;
* `TAG_REPLY` receiver -> sender: `TransferAck`, `TransferNack`.

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
from msgspec import Meta

from shared.events.base import MAX_BYTES, Message, Reason
from shared.events.common import LayerRange

from .errors import FailureReason

TAG_FRAME = 0x7444_0001
TAG_DATA = 0x7444_0002
TAG_REPLY = 0x7444_0003
MAX_FRAME = 4096  # bytes, length prefix included
PREPOST = 4  # receives a receiver may post beyond the chunk headers it has seen, per transfer

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


class TransferAck(Message, kw_only=True):
    """Every byte arrived, checksums matched, the destination holds the data."""

    transfer_id: TransferId
    chunks: Annotated[int, Meta(ge=0, le=2**40)]
    total_bytes: Bytes


class TransferNack(Message, kw_only=True):
    transfer_id: TransferId
    reason: FailureReason
    message: Reason = ""


SenderFrame = Hello | TransferStart | ChunkHeader | TransferAbort
ReplyFrame = TransferAck | TransferNack

_ENCODER = msgspec.msgpack.Encoder()
_SENDER_DECODER = msgspec.msgpack.Decoder(SenderFrame)
_REPLY_DECODER = msgspec.msgpack.Decoder(ReplyFrame)


def chunk_count(total_bytes: int, chunk_bytes: int) -> int:
    """Chunks of a transfer: an empty transfer still sends one (empty) chunk."""
    return max(1, -(-total_bytes // chunk_bytes))


def encode_frame(frame: SenderFrame | ReplyFrame) -> bytes:
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

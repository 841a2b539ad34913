"""Frames, byte views, segments and checksums of the data plane (no I/O)."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from services.gpu_worker.transfer.buffers import DEFAULT_CHECKSUM, Segments, byte_view, checksum_of
from services.gpu_worker.transfer.frames import (
    INLINE_MAX, MAX_FRAME, ChunkHeader, InlineTransfer, TransferNack, TransferStart, decode_inline,
    decode_reply_frame, decode_sender_frame, encode_frame, encode_inline,
)
from services.gpu_worker.transfer.plane import format_address, parse_address
from shared.events.common import LayerRange


def _frame_buffer(frame: bytes) -> memoryview:
    buf = np.zeros(MAX_FRAME, dtype=np.uint8)  # what the receiver posts: larger than the frame
    buf[: len(frame)] = np.frombuffer(frame, dtype=np.uint8)
    return memoryview(buf)


def test_frames_round_trip_through_a_larger_receive_buffer() -> None:
    start = TransferStart(transfer_id=7, kind="kv", key="kv:req-1:0-4", total_bytes=123, chunk_bytes=64, segments=[100, 23],
                          layers=LayerRange(start=0, end=4), request_id="req-1")
    header = ChunkHeader(transfer_id=7, index=3, offset=99, length=24, checksum=2**64 - 1, last=True)
    assert decode_sender_frame(_frame_buffer(encode_frame(start))) == start
    assert decode_sender_frame(_frame_buffer(encode_frame(header))) == header
    nack = TransferNack(transfer_id=7, reason="corrupt", message="chunk 3")
    assert decode_reply_frame(_frame_buffer(encode_frame(nack))) == nack


def test_malformed_frames_are_rejected() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_sender_frame(_frame_buffer(encode_frame(TransferNack(transfer_id=1, reason="corrupt"))))
    bad_kind = encode_frame(TransferStart(transfer_id=1, kind="kv", key="k", total_bytes=1, chunk_bytes=1)).replace(b"kv", b"zz")
    with pytest.raises(msgspec.ValidationError):
        decode_sender_frame(_frame_buffer(bad_kind))
    lying_length = (MAX_FRAME).to_bytes(2, "little") + b"\x00"
    with pytest.raises(msgspec.DecodeError):
        decode_sender_frame(_frame_buffer(lying_length))


def test_inline_transfer_is_one_message_read_from_a_larger_receive_buffer() -> None:
    payload = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    frame = InlineTransfer(start=TransferStart(transfer_id=9, kind="activation", key="stage-1", total_bytes=5000,
                                               chunk_bytes=5000), checksum=checksum_of(payload, DEFAULT_CHECKSUM))
    message = encode_inline(frame, payload)
    buf = np.zeros(INLINE_MAX + MAX_FRAME, dtype=np.uint8)  # the receiver's posted buffer
    buf[: message.shape[0]] = message
    got, view = decode_inline(buf)
    assert got == frame and np.array_equal(view, payload)
    assert view.base is buf or np.shares_memory(view, buf)  # a view: copied out once, into the destination
    with pytest.raises(ValueError):
        encode_inline(frame, payload[:10])  # not what the frame announces
    big = InlineTransfer(start=TransferStart(transfer_id=9, kind="activation", key="k", total_bytes=INLINE_MAX + 1,
                                             chunk_bytes=INLINE_MAX + 1), checksum=0)
    with pytest.raises(ValueError):
        encode_inline(big, np.zeros(INLINE_MAX + 1, dtype=np.uint8))
    head = encode_frame(big)  # a frame announcing more payload than the buffer holds
    short = np.zeros(len(head) + 10, dtype=np.uint8)
    short[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    with pytest.raises(msgspec.DecodeError):
        decode_inline(short)


def test_frame_size_is_bounded() -> None:
    with pytest.raises(ValueError):
        encode_frame(TransferStart(transfer_id=1, kind="kv", key="k", total_bytes=10, chunk_bytes=1, segments=[1] * 5000))


def test_byte_view_of_a_tensor_shares_its_memory() -> None:
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    view = byte_view(t)
    assert view.dtype == np.uint8 and view.shape == (12,)
    view[:] = 0x3F  # writing the bytes writes the tensor (no copy)
    assert t.view(torch.int16).flatten().tolist() == [0x3F3F] * 6
    with pytest.raises(ValueError):
        byte_view(torch.zeros(4, 4).t())  # not contiguous: refuse rather than copy silently
    assert byte_view(b"abc").tolist() == [97, 98, 99]


def test_segments_gather_and_scatter_across_boundaries() -> None:
    src = [np.arange(5, dtype=np.uint8), np.arange(10, 13, dtype=np.uint8), np.arange(20, 27, dtype=np.uint8)]
    seg = Segments(src)
    assert seg.total == 15 and seg.sizes == [5, 3, 7]
    one = seg.gather(1, 3)
    assert one.tolist() == [1, 2, 3] and np.shares_memory(one, src[0])  # inside one segment: no copy
    span = seg.gather(3, 8)
    assert span.tolist() == [3, 4, 10, 11, 12, 20, 21, 22]
    dst = Segments([np.zeros(5, np.uint8), np.zeros(3, np.uint8), np.zeros(7, np.uint8)])
    for off in range(0, 15, 4):
        n = min(4, 15 - off)
        dst.scatter(off, seg.gather(off, n))
    assert all((a == b).all() for a, b in zip(dst.views, src))
    with pytest.raises(ValueError):
        seg.pieces(10, 6)


def test_checksum_detects_one_flipped_byte() -> None:
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    for algo in (DEFAULT_CHECKSUM, "crc32"):
        before = checksum_of(data, algo)
        data[12345] ^= 0x01
        assert checksum_of(data, algo) != before
        data[12345] ^= 0x01
        assert checksum_of(data, algo) == before


def test_addresses() -> None:
    assert parse_address(format_address("10.0.0.5", 4242)) == ("10.0.0.5", 4242)
    assert parse_address(format_address("::1", 1)) == ("::1", 1)
    for bad in ("nohost", "host:", ":12", "host:port"):
        with pytest.raises(ValueError):
            parse_address(bad)

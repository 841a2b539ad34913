"""The buddy-group stage protocol: a typed msgspec header + raw tensor bytes, no pickle.

One message on the data plane is `u32 header length | msgpack header | tensor bytes`, the
tensors concatenated in the order the header's `TensorSpec`s list them. Pipeline and
remote-attention messages travel at activation priority (express lane); `KvExchange` at KV
priority, in chunks the data plane's scheduler preempts for activations.
"""
from __future__ import annotations

import struct
from typing import Annotated, Union

import msgspec
import torch
from msgspec import Meta

Id = Annotated[str, Meta(min_length=1, max_length=256)]
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_HEADER = struct.Struct("<I")
MAX_HEADER = 16 << 20


class TensorSpec(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]


class StageChunk(msgspec.Struct, frozen=True):
    """One sequence's share of a micro-batch (the owner's `ScheduledChunk` without block tables:
    every member keeps its own tables for its own layers)."""

    seq_id: Id
    start_pos: int
    token_ids: list[int]
    sample: bool = True
    adapter: str | None = None
    kv_at_owner: int = 0  # a victim: its first tokens' KV for dropped layers is still on the owner


class StagePass(msgspec.Struct, tag="stage_pass"):
    """Run stage `stage` of micro-batch `micro_id` (owned by `owner`); `hidden` unless stage 0."""

    group_id: Id
    owner: Id
    micro_id: int
    stage: int
    chunks: list[StageChunk]
    freed: list[str] = []  # sequences the owner finished or preempted: free their KV first
    hidden: TensorSpec | None = None


class StageFree(msgspec.Struct, tag="stage_free"):
    """Sequences the owner finished or preempted, when no micro-batch carries the news."""

    group_id: Id
    owner: Id
    seq_ids: list[str]


class StageDone(msgspec.Struct, tag="stage_done"):
    """The last stage's answer to the owner: logits of the sampling chunks (rows in chunk order)."""

    group_id: Id
    micro_id: int
    seq_ids: list[str]
    logits: TensorSpec | None = None
    short: list[str] = []  # a stage had no KV blocks for these: nothing ran, the owner preempts them


class AttnCall(msgspec.Struct, tag="attn_call"):
    """Remote attention: run `layer`'s attention on the KV the callee holds (q, k, v follow)."""

    group_id: Id
    caller: Id  # the member to answer
    call_id: int
    layer: int
    chunks: list[StageChunk]  # token_ids may be empty: their count is in `num_tokens`
    num_tokens: list[int]
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec


class AttnReply(msgspec.Struct, tag="attn_reply"):
    call_id: int
    out: TensorSpec | None = None
    error: str = ""


class KvEntry(msgspec.Struct, frozen=True):
    seq_id: Id
    num_tokens: int  # tokens [0, num_tokens) of the layer, [2, n, kv_heads, d] in the payload


class KvExchange(msgspec.Struct, tag="kv_exchange"):
    """The owner's victims' KV of one dropped layer, for the member that keeps its weights."""

    group_id: Id
    owner: Id
    layer: int
    entries: list[KvEntry]
    kv: TensorSpec  # [2, sum(num_tokens), kv_heads, d]


class KvLanded(msgspec.Struct, tag="kv_landed"):
    """The layer's KV of these sequences is now local at the sender: the owner frees its copy."""

    group_id: Id
    layer: int
    seq_ids: list[str]


class KvSpan(msgspec.Struct, frozen=True):
    seq_id: Id
    start: int  # tokens [start, end) of each layer, [2, end - start, kv_heads, d] in the payload
    end: int


class KvPull(msgspec.Struct, tag="kv_pull"):
    """Migrate-back (restore): the owner, holding every layer again, asks a member for its
    sequences' KV of the member's stage. `final`: the owner has paused them; the member frees
    them (and `freed`) once sent."""

    group_id: Id
    owner: Id
    spans: list[KvSpan]
    final: bool = False
    freed: list[str] = []


class KvReturn(msgspec.Struct, tag="kv_return"):
    """A member's answer to a `KvPull`, one per layer of its stage (entries may be empty)."""

    group_id: Id
    keeper: Id
    layer: int
    final: bool
    entries: list[KvSpan]
    kv: TensorSpec  # [2, sum(end - start), kv_heads, d]


Frame = Union[StagePass, StageFree, StageDone, AttnCall, AttnReply, KvExchange, KvLanded, KvPull, KvReturn]
_decoder = msgspec.msgpack.Decoder(Frame)
_encoder = msgspec.msgpack.Encoder()


def spec(t: torch.Tensor) -> TensorSpec:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"the stage protocol carries {sorted(_DTYPES)} tensors, not {t.dtype}")
    return TensorSpec(dtype=name, shape=list(t.shape))


def encode(frame: Frame, tensors: list[torch.Tensor] = ()) -> bytes:  # type: ignore[assignment]
    header = _encoder.encode(frame)
    parts = [_HEADER.pack(len(header)), header]
    parts += [t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in tensors]
    return b"".join(parts)


def decode(buf: bytes | bytearray | memoryview) -> tuple[Frame, list[torch.Tensor]]:
    """The header and its tensors (copies owning their memory)."""
    view = memoryview(buf).cast("B")
    if len(view) < _HEADER.size:
        raise ValueError(f"stage message of {len(view)} bytes has no header length")
    (n,) = _HEADER.unpack_from(view)
    if n > MAX_HEADER or _HEADER.size + n > len(view):
        raise ValueError(f"stage message header of {n} bytes does not fit its {len(view)}-byte message")
    frame = _decoder.decode(view[_HEADER.size:_HEADER.size + n])
    offset = _HEADER.size + n
    tensors = []
    for s in _specs(frame):
        if s.dtype not in _DTYPES:
            raise ValueError(f"unknown tensor dtype {s.dtype!r} in a {type(frame).__name__}")
        dtype = _DTYPES[s.dtype]
        nbytes = dtype.itemsize
        for d in s.shape:
            nbytes *= d
        if offset + nbytes > len(view):
            raise ValueError(f"{type(frame).__name__}: tensor {s.shape} overruns the message ({len(view)} bytes)")
        if nbytes == 0:
            tensors.append(torch.empty(s.shape, dtype=dtype))
        else:
            raw = torch.frombuffer(bytearray(view[offset:offset + nbytes]), dtype=torch.uint8)
            tensors.append(raw.view(dtype).reshape(s.shape))
        offset += nbytes
    if offset != len(view):
        raise ValueError(f"{type(frame).__name__}: {len(view) - offset} bytes after its tensors")
    return frame, tensors


def _specs(frame: Frame) -> list[TensorSpec]:
    if isinstance(frame, StagePass):
        return [frame.hidden] if frame.hidden is not None else []
    if isinstance(frame, StageDone):
        return [frame.logits] if frame.logits is not None else []
    if isinstance(frame, AttnCall):
        return [frame.q, frame.k, frame.v]
    if isinstance(frame, AttnReply):
        return [frame.out] if frame.out is not None else []
    if isinstance(frame, (KvExchange, KvReturn)):
        return [frame.kv]
    return []

"""The control channel between the engine and its CPU LoRA helpers: fixed-size typed records.

Data never travels here: the layer's input rows and the helpers' deltas live in two shared
memory regions (`cpu_lora_helpers`). A record is a struct-packed header of fixed size; only
REGISTER carries a tail (the adapter's `SharedLayout` as JSON, UTF-8: where its shared host copy lies). Nothing is pickled: the channel is
a `multiprocessing.connection.Connection` used with `send_bytes`/`recv_bytes` only.

Projection groups: the targets one base matmul feeds with the same input (q|k|v, gate|up),
so one round trip per group and layer carries all their deltas, side by side in columns.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from .lora import target_shape
from .model_config import ModelConfig

GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
GROUP_OF = {t: g for g, targets in enumerate(GROUPS) for t in targets}


class Kind(IntEnum):
    READY = 1  # helper -> engine: started; `value` = its profiled throughput (row-rank products / s)
    REGISTER = 2  # engine -> helper: map adapter `adapter`'s shared host copy (layout in the tail)
    UNREGISTER = 3  # engine -> helper: drop adapter `adapter`
    COMPUTE = 4  # engine -> helper: rows [row, row+count) of `group` at `layer` for `adapter`
    DONE = 5  # helper -> engine: `seq` written; `status` 0 ok; `value` = compute seconds
    SHUTDOWN = 6


class Status(IntEnum):
    OK = 0
    UNKNOWN_ADAPTER = 1  # never registered, or its directory could not be read
    ERROR = 2


# kind, status, group, adapter, layer, row, count, in_dim, out_cols, seq, gate, value
_HEADER = struct.Struct("<BBHIIIIIIQQd")
HEADER_SIZE = _HEADER.size


@dataclass(frozen=True, slots=True)
class Record:
    kind: Kind
    seq: int = 0
    adapter: int = 0
    layer: int = 0
    group: int = 0
    row: int = 0
    count: int = 0
    in_dim: int = 0
    out_cols: int = 0
    status: int = 0
    value: float = 0.0
    path: str = ""  # REGISTER only: the SharedLayout, encoded
    gate: int = 0  # COMPUTE: wait until the doorbell reads >= gate (the input rows have landed)

    def encode(self) -> bytes:
        head = _HEADER.pack(self.kind, self.status, self.group, self.adapter, self.layer, self.row, self.count,
                            self.in_dim, self.out_cols, self.seq, self.gate, self.value)
        return head + self.path.encode() if self.kind is Kind.REGISTER else head


def decode(data: bytes) -> Record:
    """A record from its bytes; ValueError names what is wrong with a malformed one."""
    if len(data) < HEADER_SIZE:
        raise ValueError(f"control record of {len(data)} bytes, shorter than its {HEADER_SIZE}-byte header")
    kind, status, group, adapter, layer, row, count, in_dim, out_cols, seq, gate, value = _HEADER.unpack_from(data)
    try:
        kind = Kind(kind)
    except ValueError:
        raise ValueError(f"control record of unknown kind {kind}") from None
    tail = data[HEADER_SIZE:]
    if tail and kind is not Kind.REGISTER:
        raise ValueError(f"{kind.name} record with a {len(tail)}-byte tail (only REGISTER has one)")
    if group >= len(GROUPS):
        raise ValueError(f"control record names projection group {group}, there are {len(GROUPS)}")
    return Record(kind, seq, adapter, layer, group, row, count, in_dim, out_cols, status, value, tail.decode(), gate)


def group_layout(cfg: ModelConfig, group: int) -> tuple[int, list[tuple[str, int, int]]]:
    """(input width, [(target, first column, width)]) of a group's row in the shared regions."""
    targets = GROUPS[group]
    in_dim = target_shape(cfg, targets[0])[0]
    cols, at = [], 0
    for target in targets:
        width = target_shape(cfg, target)[1]
        cols.append((target, at, width))
        at += width
    return in_dim, cols


def region_widths(cfg: ModelConfig) -> tuple[int, int]:
    """The widest input row and the widest output row over all groups (region sizing)."""
    layouts = [group_layout(cfg, g) for g in range(len(GROUPS))]
    return max(i for i, _ in layouts), max(sum(w for _, _, w in cols) for _, cols in layouts)

"""Per-step attention layout built from the scheduler's chunks, vectorised over layers.

The block tables of all sequences and all KV-holding layers are flattened into ONE list
and turned into tensors with a handful of ops, so the cost per step is a few list
extends per (sequence, layer) plus O(1) tensor ops — not a Python loop per token.

Token order is the chunks' order: chunk b owns rows [row_start[b], row_start[b] + q_len).
Decode chunks (one token) are attended in batched SDPA calls over keys padded to the
longest context of the call; to bound that padding they are sorted by context length and
cut into groups (`split_by_length`). Prefill chunks (more than one token) go one by one
(a step holds few of them under a token budget).
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import ScheduledChunk


@dataclass(slots=True)
class PrefillChunk:
    index: int  # chunk index in the step
    row_start: int
    q_len: int
    start_pos: int

    @property
    def ctx_len(self) -> int:
        return self.start_pos + self.q_len


@dataclass(slots=True)
class DecodeGroup:
    rows: torch.Tensor | slice  # token rows of the group's sequences
    tables: torch.Tensor  # [L, B, n_blocks] padded block tables
    key_mask: torch.Tensor  # [B, 1, 1, n_blocks * block_size] True where attending is allowed
    ctx_lens: torch.Tensor  # [B] keys per sequence (int64), for kernels that skip the padding
    layer_tables: tuple[torch.Tensor, ...] = ()  # tables[row] for each layer row (made at the first `table_of`)

    def table_of(self, row: int) -> torch.Tensor:
        """tables[row], the views made once per step (a step of one C++ call for every layer needs none)."""
        if not self.layer_tables:
            self.layer_tables = tuple(self.tables.unbind(0))
        return self.layer_tables[row]


# Padding (in blocks, summed over a group's sequences) worth one more SDPA call: below it,
# the extra call's fixed cost exceeds the copy and attention over the padding.
GROUP_SPLIT_BLOCKS = 16
# Gathered K+V of one call, which bounds the reused gather buffer. (Smaller groups that
# stay in cache between gather and SDPA measured no gain on a shared CPU.)
GROUP_MAX_BYTES = 64 << 20


def split_by_length(
    nbs: list[int], block_bytes: int = 0, threshold: int = GROUP_SPLIT_BLOCKS, max_bytes: int = GROUP_MAX_BYTES
) -> list[list[int]]:
    """Indices of `nbs` (blocks per sequence) grouped for batched decode attention: sorted
    ascending, a new group starts when the next sequence would pad the group's earlier
    members by more than `threshold` blocks in total, or would make the group's gathered
    KV exceed `max_bytes` (a group always takes at least one sequence)."""
    order = sorted(range(len(nbs)), key=nbs.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        if (
            g is not None
            and (nbs[i] - nbs[g[-1]]) * len(g) <= threshold
            and (len(g) + 1) * nbs[i] * block_bytes <= max_bytes
        ):
            g.append(i)
        else:
            groups.append([i])
    return groups


@dataclass(slots=True)
class StepLayout:
    num_tokens: int
    positions: torch.Tensor  # [T]
    layer_rows: dict[int, int]  # layer -> row in the per-layer tensors
    slots: torch.Tensor | None  # [L, T] KV slot of each new token per layer
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    prefill_tables: list[torch.Tensor]  # per prefill chunk: [L, n_blocks]
    block_size: int
    layer_slots: tuple[torch.Tensor, ...] = ()  # slots[row] for each layer row (made at the first `slots_of`)
    # every token decodes, in one group over rows [0, T) in order: attention's output is the group's
    all_decode: bool = False

    def slots_of(self, row: int) -> torch.Tensor:
        """slots[row], the views made once per step, at the first call."""
        if not self.layer_slots:
            assert self.slots is not None
            self.layer_slots = tuple(self.slots.unbind(0))
        return self.layer_slots[row]

    def layer_row(self, layer: int) -> int:
        row = self.layer_rows.get(layer)
        if row is None:
            raise RuntimeError(f"no KV for layer {layer} in this step (held: {sorted(self.layer_rows)})")
        return row


def build_step_layout(
    chunks: Sequence[ScheduledChunk],
    layers: Sequence[int],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    block_bytes: int = 0,
    split_decode: bool = True,
) -> StepLayout:
    """`layers`: the layers whose KV this object holds (their block tables are read).
    `split_decode=False`: one decode group (for a kernel that does not pay for padding)."""
    if not split_decode and layers and chunks and all(len(c.token_ids) == 1 for c in chunks):
        return _all_decode_layout(chunks, layers, block_size, device, sliding_window)
    return _general_layout(chunks, layers, block_size, device, sliding_window, block_bytes, split_decode)


def _table(chunk: ScheduledChunk, layer: int, blocks: int, tokens: int) -> list[int]:
    """The chunk's block table for `layer`, checked to hold the `blocks` its `tokens` need."""
    table = chunk.block_tables.get(layer)
    if table is None:
        raise ValueError(f"chunk of {chunk.seq_id!r} has no block table for layer {layer}")
    if len(table) < blocks:
        raise ValueError(f"block table of {chunk.seq_id!r} layer {layer} has {len(table)} blocks, "
                         f"needs {blocks} for {tokens} tokens")
    return table


def _general_layout(
    chunks: Sequence[ScheduledChunk], layers: Sequence[int], block_size: int, device: torch.device,
    sliding_window: int | None, block_bytes: int, split_decode: bool,
) -> StepLayout:
    q_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start_pos for c in chunks]
    total = sum(q_lens)
    nbs = [-(-(s + q) // block_size) for s, q in zip(starts, q_lens)]
    n_per_layer = sum(nbs)
    flat = array("q")  # int64; fromlist + frombuffer: ~4x cheaper than torch.tensor(list)
    for layer in layers:
        for c, nb in zip(chunks, nbs):
            table = _table(c, layer, nb, c.start_pos + len(c.token_ids))
            part = table if len(table) == nb else table[:nb]
            if isinstance(part, list):
                flat.fromlist(part)
            else:
                flat.extend(part)
    n_layers = len(layers)
    q_len_t = torch.tensor(q_lens, dtype=torch.long)
    starts_t = torch.tensor(starts, dtype=torch.long)
    tok_seq = torch.repeat_interleave(torch.arange(len(chunks)), q_len_t)
    row_start = torch.cumsum(q_len_t, 0) - q_len_t
    positions = starts_t[tok_seq] + (torch.arange(total) - row_start[tok_seq])

    decode_idx = [b for b, q in enumerate(q_lens) if q == 1]
    prefills = [PrefillChunk(b, int(row_start[b]), q_lens[b], starts[b]) for b, q in enumerate(q_lens) if q > 1]

    slots = None
    groups: list[DecodeGroup] = []
    prefill_tables: list[torch.Tensor] = []
    if n_layers:
        # frombuffer shares the array's memory (the tensor keeps it alive); it refuses an empty one
        tables_t = torch.frombuffer(flat, dtype=torch.long) if flat else torch.empty(0, dtype=torch.long)
        tables_flat = tables_t.view(n_layers, n_per_layer)
        nbs_t = torch.tensor(nbs, dtype=torch.long)
        offsets = torch.cumsum(nbs_t, 0) - nbs_t
        block_of_token = offsets[tok_seq] + positions // block_size
        slots = tables_flat[:, block_of_token] * block_size + positions % block_size
        if decode_idx:
            split = split_by_length([nbs[b] for b in decode_idx], block_bytes) if split_decode else [
                list(range(len(decode_idx)))]
            for members in split:
                idx = [decode_idx[m] for m in members]
                groups.append(_decode_group(idx, nbs, nbs_t, offsets, starts_t, row_start,
                                            tables_flat, block_size, sliding_window, device))
        for p in prefills:
            lo = int(offsets[p.index])
            prefill_tables.append(tables_flat[:, lo : lo + nbs[p.index]].to(device, non_blocking=True))
        slots = slots.to(device, non_blocking=True)
    first_rows = groups[0].rows if len(groups) == 1 else None
    whole = not prefills and isinstance(first_rows, slice) and first_rows == slice(0, total)
    return StepLayout(
        num_tokens=total,
        positions=positions.to(device, non_blocking=True),
        layer_rows={layer: i for i, layer in enumerate(layers)},
        slots=slots,
        decode_groups=groups,
        prefills=prefills,
        prefill_tables=prefill_tables,
        block_size=block_size,
        all_decode=whole,
    )


def _decode_group(
    idx: list[int], nbs: list[int], nbs_t: torch.Tensor, offsets: torch.Tensor,
    starts_t: torch.Tensor, row_start: torch.Tensor, tables_flat: torch.Tensor, block_size: int,
    sliding_window: int | None, device: torch.device,
) -> DecodeGroup:
    d_idx = torch.tensor(idx, dtype=torch.long)
    max_nb = max(nbs[b] for b in idx)
    cols = torch.arange(max_nb)
    valid = cols[None, :] < nbs_t[d_idx, None]
    # padding columns repeat the sequence's first block; the key mask hides them
    gather = torch.where(valid, offsets[d_idx, None] + cols[None, :], offsets[d_idx, None])
    key_pos = torch.arange(max_nb * block_size)
    ctx = (starts_t[d_idx] + 1)[:, None]
    mask = key_pos[None, :] < ctx
    if sliding_window is not None:
        mask &= key_pos[None, :] > ctx - 1 - sliding_window
    contiguous = all(b == idx[0] + n for n, b in enumerate(idx))  # chunk order = token order here
    tables = tables_flat[:, gather].to(device, non_blocking=True)
    return DecodeGroup(
        rows=slice(int(row_start[idx[0]]), int(row_start[idx[-1]]) + 1) if contiguous else
        row_start[d_idx].to(device, non_blocking=True),
        tables=tables,
        key_mask=mask[:, None, None, :].to(device, non_blocking=True),
        ctx_lens=ctx[:, 0].to(device, non_blocking=True),
    )


def _all_decode_layout(
    chunks: Sequence[ScheduledChunk], layers: Sequence[int], block_size: int, device: torch.device,
    sliding_window: int | None,
) -> StepLayout:
    """`build_step_layout` of a step where every chunk decodes one token, into one group (a kernel's):
    the same tensors from the block tables in one pass of Python ints (a single-stream decode step of
    30 layers took ~0.7 ms of tensor ops the general path needs for prefill chunks)."""
    starts = [c.start_pos for c in chunks]
    nbs = [s // block_size + 1 for s in starts]
    width = max(nbs)
    slots, tables = array("q"), array("q")  # [L, B] and [L, B, width], padding: the sequence's first block
    for layer in layers:
        for c, nb, start in zip(chunks, nbs, starts):
            table = _table(c, layer, nb, start + 1)
            slots.append(table[nb - 1] * block_size + start % block_size)
            tables.extend(table[:nb])
            if nb < width:
                tables.extend([table[0]] * (width - nb))
    n_layers, batch = len(layers), len(chunks)
    positions = torch.tensor(starts, dtype=torch.long)
    ctx = positions + 1
    key_pos = torch.arange(width * block_size)
    mask = key_pos[None, :] < ctx[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > ctx[:, None] - 1 - sliding_window
    slots_t = torch.frombuffer(slots, dtype=torch.long).view(n_layers, batch).to(device, non_blocking=True)
    tables_t = torch.frombuffer(tables, dtype=torch.long).view(n_layers, batch, width).to(device, non_blocking=True)
    group = DecodeGroup(rows=slice(0, batch), tables=tables_t, key_mask=mask[:, None, None, :].to(device, non_blocking=True),
                        ctx_lens=ctx.to(device, non_blocking=True))
    return StepLayout(
        num_tokens=batch, positions=positions.to(device, non_blocking=True),
        layer_rows={layer: i for i, layer in enumerate(layers)}, slots=slots_t, decode_groups=[group], prefills=[],
        prefill_tables=[], block_size=block_size, all_decode=True,
    )

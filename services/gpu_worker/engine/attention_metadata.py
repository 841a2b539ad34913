"""Per-step attention layout built from the scheduler's chunks, vectorised over layers.

The block tables of all sequences and all KV-holding layers are flattened into ONE list
and turned into tensors with a handful of ops, so the cost per step is a few list
extends per (sequence, layer) plus O(1) tensor ops — not a Python loop per token.

Token order is the chunks' order: chunk b owns rows [row_start[b], row_start[b] + q_len).
Decode chunks (one token) are attended together in one batched SDPA; prefill chunks
(more than one token) one by one (a step holds few of them under a token budget).
"""
from __future__ import annotations

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
class StepLayout:
    num_tokens: int
    positions: torch.Tensor  # [T]
    layer_rows: dict[int, int]  # layer -> row in the per-layer tensors
    slots: torch.Tensor | None  # [L, T] KV slot of each new token per layer
    decode_rows: torch.Tensor | None  # token rows of decode chunks (None: no decode chunk)
    all_decode: bool  # every chunk is a decode chunk (rows are 0..T-1)
    decode_tables: torch.Tensor | None  # [L, Bd, max_blocks_decode]
    decode_key_mask: torch.Tensor | None  # [Bd, 1, 1, S] True where attending is allowed
    prefills: list[PrefillChunk]
    prefill_tables: list[torch.Tensor]  # per prefill chunk: [L, n_blocks]
    block_size: int

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
) -> StepLayout:
    """`layers`: the layers whose KV this object holds (their block tables are read)."""
    q_lens = [len(c.token_ids) for c in chunks]
    starts = [c.start_pos for c in chunks]
    total = sum(q_lens)
    nbs = [-(-(s + q) // block_size) for s, q in zip(starts, q_lens)]
    n_per_layer = sum(nbs)
    flat: list[int] = []
    for layer in layers:
        for c, nb in zip(chunks, nbs):
            table = c.block_tables.get(layer)
            if table is None:
                raise ValueError(f"chunk of {c.seq_id!r} has no block table for layer {layer}")
            if len(table) < nb:
                raise ValueError(
                    f"block table of {c.seq_id!r} layer {layer} has {len(table)} blocks, "
                    f"needs {nb} for {c.start_pos + len(c.token_ids)} tokens"
                )
            flat.extend(table if len(table) == nb else table[:nb])
    n_layers = len(layers)
    cpu = torch.device("cpu")
    q_len_t = torch.tensor(q_lens, dtype=torch.long)
    starts_t = torch.tensor(starts, dtype=torch.long)
    tok_seq = torch.repeat_interleave(torch.arange(len(chunks)), q_len_t)
    row_start = torch.cumsum(q_len_t, 0) - q_len_t
    positions = starts_t[tok_seq] + (torch.arange(total) - row_start[tok_seq])

    decode_idx = [b for b, q in enumerate(q_lens) if q == 1]
    all_decode = len(decode_idx) == len(chunks)
    prefills = [PrefillChunk(b, int(row_start[b]), q_lens[b], starts[b]) for b, q in enumerate(q_lens) if q > 1]

    slots = decode_tables = key_mask = decode_rows = None
    prefill_tables: list[torch.Tensor] = []
    if n_layers:
        tables_flat = torch.tensor(flat, dtype=torch.long).view(n_layers, n_per_layer)
        nbs_t = torch.tensor(nbs, dtype=torch.long)
        offsets = torch.cumsum(nbs_t, 0) - nbs_t
        block_of_token = offsets[tok_seq] + positions // block_size
        slots = tables_flat[:, block_of_token] * block_size + positions % block_size
        if decode_idx:
            d_idx = torch.tensor(decode_idx, dtype=torch.long)
            max_nb = max(nbs[b] for b in decode_idx)
            cols = torch.arange(max_nb)
            valid = cols[None, :] < nbs_t[d_idx, None]
            gather = torch.where(valid, offsets[d_idx, None] + cols[None, :], offsets[d_idx, None])
            decode_tables = tables_flat[:, gather].to(device)
            key_pos = torch.arange(max_nb * block_size)
            ctx = (starts_t[d_idx] + 1)[:, None]
            mask = key_pos[None, :] < ctx
            if sliding_window is not None:
                mask &= key_pos[None, :] > ctx - 1 - sliding_window
            key_mask = mask[:, None, None, :].to(device)
            decode_rows = row_start[d_idx].to(device)
        for p in prefills:
            lo = int(offsets[p.index])
            prefill_tables.append(tables_flat[:, lo : lo + nbs[p.index]].to(device))
        slots = slots.to(device)
    elif decode_idx:
        decode_rows = row_start[torch.tensor(decode_idx, dtype=torch.long)].to(device)
    return StepLayout(
        num_tokens=total,
        positions=positions.to(device) if device != cpu else positions,
        layer_rows={layer: i for i, layer in enumerate(layers)},
        slots=slots,
        decode_rows=decode_rows,
        all_decode=all_decode,
        decode_tables=decode_tables,
        decode_key_mask=key_mask,
        prefills=prefills,
        prefill_tables=prefill_tables,
        block_size=block_size,
    )

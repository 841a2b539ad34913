"""Paged attention in torch over `PagedKVCache`.

`PagedAttention` is a `LayerAttention`: given one layer's q and new k/v for the step, it
writes k/v into the cache slots, gathers each sequence's keys by its block table and runs
causal SDPA with each query at its true position (chunked prefill and decode alike).

The same class serves the model's own layers and remote attention: an object holding
only some layers' KV (its own cache and block tables) is prepared with its own view of
the step and called with the q/k/v another worker computed.

Decode (one query per sequence) reads the blocks in place where a kernel applies: on
CUDA gpu_ext's Triton kernel (GQA-aware, split-K for long contexts; imported only there), on
fp32 CPU gpu_ext's C++ kernel. Otherwise the blocks are gathered into reused buffers and
SDPA runs with query heads sharing a kv head folded into the query-length axis (GQA without
repeating KV). Prefill chunks use SDPA's enable_gqa (flash attention on CUDA in 16 bits when
the whole prompt is in the chunk).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from gpu_ext.cpu_attention import paged_decode_kernel

from .attention_metadata import DecodeGroup, StepLayout, build_step_layout
from .batch import ScheduledChunk
from .kv_cache import PagedKVCache
from .models.llama import DecodeKV


class PagedAttention:
    def __init__(
        self, cache: PagedKVCache, layers: Sequence[int], sliding_window: int | None = None,
        use_kernel: bool | None = None,
    ) -> None:
        """`use_kernel`: decode with gpu_ext's CPU kernel (None: when it builds and applies)."""
        self.cache = cache
        self.layers = list(layers)  # layers whose KV lives in `cache`
        self.sliding_window = sliding_window
        self.layout: StepLayout | None = None
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        device = cache.blocks.device
        applies = device.type == "cpu" and cache.blocks.dtype == torch.float32
        self._kernel = paged_decode_kernel() if applies and use_kernel is not False else None
        if device.type == "cuda" and use_kernel is not False:
            self._kernel = _triton_decode(device, cache.cfg.num_kv_heads)
        if use_kernel and self._kernel is None:
            raise RuntimeError("no paged attention kernel applies here (fp32 CPU or CUDA)")

    def prepare(self, chunks: Sequence[ScheduledChunk]) -> StepLayout:
        """Build this step's layout from the chunks (their block tables for our layers)."""
        self.layout = build_step_layout(
            chunks, self.layers, self.cache.block_size, self.cache.blocks.device, self.sliding_window,
            self.cache.block_bytes, split_decode=self._kernel is None,
        )
        return self.layout

    def decode_kv(self, layers: range) -> DecodeKV | None:
        """This step's KV for `LlamaModel.decode_layers` over `layers`: where every token decodes, the
        fp32 CPU kernel attends, and those layers' KV is here in consecutive rows; else None."""
        lay = self.layout
        if lay is None or not lay.all_decode or self._kernel is None or self.cache.blocks.device.type != "cpu":
            return None
        first = lay.layer_rows.get(layers.start)
        if first is None or any(lay.layer_rows.get(i) != first + n for n, i in enumerate(layers)):
            return None
        assert lay.slots is not None
        group, rows = lay.decode_groups[0], slice(first, first + len(layers))
        return DecodeKV(self.cache.keys, self.cache.values, lay.slots[rows], group.tables[rows], group.ctx_lens,
                        self.cache.cfg.head_dim**-0.5, self.sliding_window or 0)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if lay is None:
            raise RuntimeError("PagedAttention.prepare() was not called for this step")
        if q.shape[0] != lay.num_tokens:
            raise ValueError(f"attention got {q.shape[0]} tokens, the step has {lay.num_tokens}")
        row = lay.layer_row(layer)
        assert lay.slots is not None
        self.cache.write(lay.slots_of(row), k, v)
        groups = lay.decode_groups
        if lay.all_decode:  # one call makes every row: no output buffer to fill
            return self._decode(row, q, groups[0])
        out = torch.empty_like(q)
        for g in groups:
            out[g.rows] = self._decode(row, q[g.rows], g)
        for p, tables in zip(lay.prefills, lay.prefill_tables):
            rows = slice(p.row_start, p.row_start + p.q_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], tables[row], p.start_pos)
        return out

    def _buffers(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused gather buffers (kept hot in cache, never re-faulted) for `blocks` blocks."""
        per_block = self.cache.block_bytes // 2 // self.cache.blocks.element_size()
        if self._kbuf is None or self._kbuf.numel() < blocks * per_block:
            size = max(blocks, 64) * per_block
            self._kbuf = torch.empty(size, dtype=self.cache.blocks.dtype, device=self.cache.blocks.device)
            self._vbuf = torch.empty_like(self._kbuf)
        assert self._vbuf is not None
        return self._kbuf, self._vbuf

    def _decode(self, row: int, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        batch, heads, d = q.shape
        if self._kernel is not None:  # reads the blocks in place: no gather, no padding
            return self._kernel(q.contiguous(), self.cache.keys, self.cache.values, group.table_of(row),
                                group.ctx_lens, d**-0.5, self.sliding_window or 0)
        kv_heads = self.cache.cfg.num_kv_heads
        table = group.tables[row]
        keys, values = self.cache.gather(table, *self._buffers(table.numel()))  # [B, S, kv_heads, d]
        qg = q.view(batch, kv_heads, heads // kv_heads, d)  # query heads of a kv head as rows
        out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=group.key_mask)
        return out.reshape(batch, heads, d)  # not contiguous from the CUDA kernels

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int
    ) -> torch.Tensor:
        q_len = q.shape[0]
        ctx = start + q_len
        if start == 0 and self.sliding_window is None:
            # whole prompt in this chunk: the new k/v are all the keys there are
            keys, values, mask, causal = k, v, None, True
        else:
            keys, values = self.cache.gather(table)  # [n_blocks * block_size, kv_heads, d]
            keys, values = keys[:ctx], values[:ctx]
            q_pos = torch.arange(start, ctx, device=q.device)[:, None]
            k_pos = torch.arange(ctx, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            causal = False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)


def _triton_decode(device: torch.device, kv_heads: int):
    """gpu_ext's Triton decode kernel with split-K chosen per call from the batch and the
    table width (an upper bound of the context: no device read)."""
    from gpu_ext.triton_attention import choose_splits, paged_decode

    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def decode(q, keys, values, tables, ctx_lens, scale, window):
        splits = choose_splits(q.shape[0], kv_heads, tables.shape[-1] * keys.shape[1], sms)
        return paged_decode(q, keys, values, tables, ctx_lens, scale, window, num_splits=splits)

    return decode

"""The engine's decode attention over a paged cache, the torch path or the Triton kernel: the
reference the CPU interpreter tests (tests/engine) and the CUDA tests (tests/gpu) both compare with."""
from __future__ import annotations

import torch

from services.gpu_worker.engine.attention import PagedAttention
from services.gpu_worker.engine.batch import ScheduledChunk
from services.gpu_worker.engine.kv_cache import PagedKVCache


def decode_attention(cache: PagedKVCache, tables: list[list[int]], ctx_lens: list[int], q: torch.Tensor,
                     window: int | None, *, use_kernel: bool) -> torch.Tensor:
    """Layer 0's decode attention for one query per sequence (prepare + its decode groups)."""
    attn = PagedAttention(cache, [0], window, use_kernel=use_kernel)
    chunks = [ScheduledChunk(f"s{i}", [0], n - 1, {0: t}) for i, (n, t) in enumerate(zip(ctx_lens, tables))]
    lay = attn.prepare(chunks)
    out = torch.empty_like(q)
    for g in lay.decode_groups:
        out[g.rows] = attn._decode(0, q[g.rows], g)
    return out

"""Paged attention on scattered blocks vs plain causal attention over contiguous K/V, for
the torch path and the CPU kernel: decode batches of mixed lengths, chunked prefill, GQA
and a sliding window."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_ext.cpu_attention import paged_decode_kernel
from services.gpu_worker.engine.attention import PagedAttention
from services.gpu_worker.engine.attention_metadata import split_by_length
from services.gpu_worker.engine.batch import ScheduledChunk
from services.gpu_worker.engine.kv_cache import PagedKVCache
from services.gpu_worker.engine.model_config import ModelConfig, RopeConfig

BS = 4


def config(kv_heads: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=10, hidden_size=64,
                       intermediate_size=8, num_layers=1, num_heads=8, num_kv_heads=kv_heads, head_dim=8,
                       rms_norm_eps=1e-6, max_position=512, rope=RopeConfig(), qkv_bias=False,
                       tie_word_embeddings=False, dtype=torch.float32)


def reference(q, k, v, start: int, window: int | None) -> torch.Tensor:
    """q [n, H, d] at positions start.., k/v [ctx, KVH, d] → [n, H, d]."""
    n, ctx = q.shape[0], k.shape[0]
    qp, kp = torch.arange(start, start + n)[:, None], torch.arange(ctx)[None, :]
    mask = kp <= qp if window is None else (kp <= qp) & (kp > qp - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


MODES = ["torch"] + (["kernel"] if paged_decode_kernel() is not None else [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_heads,window", [(2, None), (8, None), (1, 5)])
def test_paged_attention_matches_contiguous(mode, kv_heads, window):
    cfg = config(kv_heads)
    gen = torch.Generator().manual_seed(kv_heads)
    cache = PagedKVCache(cfg, max_blocks=200, block_size=BS)
    attn = PagedAttention(cache, [0], window, use_kernel=mode == "kernel")
    # (tokens already in the cache, new tokens this step): decodes of mixed lengths and
    # prefill chunks, one starting mid-block
    shapes = [(0, 9), (11, 1), (3, 1), (30, 1), (6, 5), (0, 1), (17, 1)]
    free = torch.randperm(200, generator=gen).tolist()  # scattered block ids
    seqs = []
    for past, new in shapes:
        table = [free.pop() for _ in range(-(-(past + new) // BS))]
        k = torch.randn(past + new, kv_heads, 8, generator=gen)
        v = torch.randn(past + new, kv_heads, 8, generator=gen)
        if past:
            cache.import_tokens(table, torch.stack([k[:past], v[:past]]))
        seqs.append((past, new, table, k, v))
    chunks = [ScheduledChunk(f"s{i}", [0] * new, past, {0: table}) for i, (past, new, table, _, _) in enumerate(seqs)]
    attn.prepare(chunks)
    q = torch.randn(sum(n for _, n, *_ in seqs), 8, 8, generator=gen)
    out = attn(0, q, torch.cat([k[p:] for p, _, _, k, _ in seqs]), torch.cat([v[p:] for p, _, _, _, v in seqs]))
    row = 0
    for past, new, _, k, v in seqs:
        expected = reference(q[row:row + new], k, v, past, window)
        assert (out[row:row + new] - expected).abs().max() < 1e-5
        row += new


def test_decode_groups_bound_padding():
    nbs = [3, 40, 4, 41, 3, 90]
    groups = split_by_length(nbs, block_bytes=1, threshold=4)
    assert sorted(i for g in groups for i in g) == list(range(len(nbs)))
    for g in groups:
        assert sum(max(nbs[i] for i in g) - nbs[i] for i in g) <= 4
    assert len(groups) == 3

"""gpu_ext's Triton paged decode kernel compiled on CUDA against the engine's torch path (blocks
gathered, SDPA) on the same device: Llama-like heads (128 dims, 32/8 and 28/4 heads), bf16 and
fp32, scattered blocks of 16, contexts from 1 to 5000 tokens, split-K, a sliding window, a
static table read through a row map with padding rows, and the graphs' KV write."""
from __future__ import annotations

import pytest
import torch

from paged_decode import decode_attention
from services.gpu_worker.engine.kv_cache import PagedKVCache
from services.gpu_worker.engine.model_config import ModelConfig, RopeConfig

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.timeout(300)]
DEVICE = "cuda:0"
BS = 16
D = 128
CTX = [1, 15, 16, 17, 300, 1029, 5000, 64]


def config(heads: int, kv_heads: int, dtype: torch.dtype) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=10, hidden_size=heads * D,
                       intermediate_size=8, num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=D,
                       rms_norm_eps=1e-6, max_position=8192, rope=RopeConfig(), qkv_bias=False,
                       tie_word_embeddings=False, dtype=dtype)


def setup(heads: int, kv_heads: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    n_blocks = sum(-(-n // BS) for n in CTX) + 64
    cache = PagedKVCache(config(heads, kv_heads, dtype), max_blocks=n_blocks, block_size=BS, device=DEVICE)
    cache.back_blocks(list(range(n_blocks)))
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=gen, device=DEVICE).to(dtype))
    order = torch.randperm(n_blocks, device="cpu", generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [[order.pop() for _ in range(-(-n // BS))] for n in CTX]
    q = torch.randn(len(CTX), heads, D, generator=gen, device=DEVICE).to(dtype)
    return cache, tables, q


def decode_with(cache, tables, q, window, use_kernel: bool) -> torch.Tensor:
    return decode_attention(cache, tables, CTX, q, window, use_kernel=use_kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,window", [(32, 8, None), (28, 4, None), (32, 8, 700), (8, 8, None)])
def test_engine_kernel_matches_the_torch_path(dtype, heads, kv_heads, window):
    cache, tables, q = setup(heads, kv_heads, dtype, seed=heads + kv_heads)
    expected = decode_with(cache, tables, q, window, use_kernel=False)
    got = decode_with(cache, tables, q, window, use_kernel=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("splits", [1, 7, 32])
def test_split_k_and_a_static_table_with_padding_rows(splits):
    from gpu_ext.triton_attention import paged_decode

    cache, tables, q = setup(32, 8, torch.bfloat16, seed=splits)
    expected = decode_with(cache, tables, q, None, use_kernel=False)
    width = max(len(t) for t in tables)
    static = torch.zeros(len(tables) + 3, width, dtype=torch.int32, device=DEVICE)
    rows = torch.randperm(len(tables) + 3)[: len(tables)]
    for r, t in zip(rows.tolist(), tables):
        static[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    padded_q = torch.cat([q, q[:2]])
    ctx = torch.tensor(CTX + [0, 0], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(padded_q, float("nan"))
    paged_decode(padded_q, cache.keys, cache.values, static, ctx, D**-0.5, rows=torch.cat([rows, rows[:2]]).to(DEVICE),
                 num_splits=splits, out=out)
    torch.testing.assert_close(out[: len(CTX)].float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(out[len(CTX):]) == 0


def test_write_kv_on_cuda_stores_at_the_slots_and_skips_padding():
    from gpu_ext.triton_attention import write_kv

    cache, tables, _ = setup(32, 8, torch.bfloat16, seed=3)
    before = cache.blocks.clone()
    pos = [0, 14, 16, 299]
    k = torch.randn(5, 8, D, device=DEVICE).to(torch.bfloat16)
    v = torch.randn(5, 8, D, device=DEVICE).to(torch.bfloat16)
    table = torch.zeros(len(tables), 400, dtype=torch.int32, device=DEVICE)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    write_kv(k, v, cache.keys, cache.values, table, torch.tensor([0, 1, 3, 4, 0], device=DEVICE),
             torch.tensor(pos + [-1], device=DEVICE))
    expected = before
    for i, (r, p) in enumerate(zip([0, 1, 3, 4], pos)):
        expected[0, tables[r][p // BS], p % BS] = k[i]
        expected[1, tables[r][p // BS], p % BS] = v[i]
    assert torch.equal(cache.blocks, expected)

"""The Triton paged decode kernel (gpu_ext/triton_attention.py) under Triton's interpreter on
CPU, against the engine's torch path (blocks gathered, SDPA): decode batches of mixed
lengths on scattered blocks, GQA groups of 1/4/8, a sliding window, split-K, a table kept in
a static buffer with a row map and padding rows, and the KV write of the CUDA graphs.

On CUDA the same kernels run compiled (tests/gpu/test_cuda_kernels.py)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is in the dev extras")
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it where there is no NVIDIA driver
    pytest.skip("Triton's interpreter is off (a CUDA machine: tests/gpu runs these kernels compiled)",
                allow_module_level=True)
from gpu_ext.triton_attention import choose_splits, paged_decode, write_kv
from paged_decode import decode_attention

from services.gpu_worker.engine.kv_cache import PagedKVCache
from services.gpu_worker.engine.model_config import ModelConfig, RopeConfig

BS = 4
HEADS = 8
D = 16
N_BLOCKS = 160


def config(kv_heads: int, dtype: torch.dtype = torch.float32) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=10, hidden_size=HEADS * D,
                       intermediate_size=8, num_layers=1, num_heads=HEADS, num_kv_heads=kv_heads, head_dim=D,
                       rms_norm_eps=1e-6, max_position=512, rope=RopeConfig(), qkv_bias=False,
                       tie_word_embeddings=False, dtype=dtype)


def filled_cache(kv_heads: int, ctx_lens: list[int], seed: int, dtype=torch.float32):
    """A cache whose sequences hold random K/V on scattered blocks; their tables."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(config(kv_heads, dtype), max_blocks=N_BLOCKS, block_size=BS)
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=gen).to(dtype))
    free = torch.randperm(N_BLOCKS, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in ctx_lens]
    return cache, tables, gen


def torch_path(cache: PagedKVCache, tables: list[list[int]], ctx_lens: list[int], q: torch.Tensor,
               window: int | None) -> torch.Tensor:
    """The engine's torch decode attention over the same cache."""
    return decode_attention(cache, tables, ctx_lens, q, window, use_kernel=False)


def padded(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def test_the_module_runs_under_the_interpreter():
    from gpu_ext import triton_attention

    assert type(triton_attention._paged_decode_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("kv_heads,window,splits", [(2, None, 1), (8, None, 1), (1, None, 3), (2, 9, 1), (2, 9, 4)])
def test_kernel_matches_the_torch_path(kv_heads, window, splits):
    ctx_lens = [1, 4, 5, 17, 38, 64, 3]
    cache, tables, gen = filled_cache(kv_heads, ctx_lens, seed=kv_heads * 10 + splits)
    q = torch.randn(len(ctx_lens), HEADS, D, generator=gen)
    expected = torch_path(cache, tables, ctx_lens, q, window)
    got = paged_decode(q, cache.keys, cache.values, padded(tables, 16), torch.tensor(ctx_lens), D**-0.5,
                       window or 0, num_splits=splits, block_n=16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_kernel_is_within_bf16_rounding_of_the_fp32_path():
    ctx_lens = [7, 33, 20]
    cache, tables, gen = filled_cache(2, ctx_lens, seed=5)
    q = torch.randn(len(ctx_lens), HEADS, D, generator=gen)
    expected = torch_path(cache, tables, ctx_lens, q, None)
    low = PagedKVCache(config(2, torch.float16), max_blocks=N_BLOCKS, block_size=BS)
    low.blocks.copy_(cache.blocks.to(torch.float16))
    got = paged_decode(q.half(), low.keys, low.values, padded(tables, 16), torch.tensor(ctx_lens), D**-0.5,
                       num_splits=2, block_n=16)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


def test_row_map_and_padding_rows_of_a_static_table():
    """Batch rows read their table through `rows` (as the CUDA graphs keep it); a context of 0
    is a padding row and comes out as zeros."""
    ctx_lens = [9, 30, 2]
    cache, tables, gen = filled_cache(2, ctx_lens, seed=11)
    q = torch.randn(4, HEADS, D, generator=gen)
    expected = torch_path(cache, tables, ctx_lens, q[:3], None)
    static = torch.zeros(6, 16, dtype=torch.int32)  # rows 5, 0, 3 hold the three sequences
    for r, t in zip([5, 0, 3], tables):
        static[r, : len(t)] = torch.tensor(t)
    rows = torch.tensor([5, 0, 3, 0], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, cache.keys, cache.values, static, torch.tensor([*ctx_lens, 0], dtype=torch.int32), D**-0.5,
                 rows=rows, num_splits=2, out=out, block_n=16)
    torch.testing.assert_close(out[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_write_kv_stores_at_the_tables_slot_and_skips_padding():
    cache, tables, gen = filled_cache(2, [6, 13], seed=2)
    before = cache.blocks.clone()
    k, v = torch.randn(3, 2, D, generator=gen), torch.randn(3, 2, D, generator=gen)
    positions = torch.tensor([5, 12, -1])  # the third row is padding
    write_kv(k, v, cache.keys, cache.values, padded(tables, 8), torch.tensor([0, 1, 0]), positions)
    expected = before.clone()
    for i, (t, pos) in enumerate(zip(tables, [5, 12])):
        expected[0, t[pos // BS], pos % BS] = k[i]
        expected[1, t[pos // BS], pos % BS] = v[i]
    assert torch.equal(cache.blocks, expected)


def test_split_choice_fills_the_sms_without_short_splits():
    assert choose_splits(64, 8, 4096, 132) == 1  # 512 programs: more than the SMs already
    assert choose_splits(1, 8, 4096, 132) == 16  # 8 programs, 4096 tokens: 256 per split
    assert choose_splits(1, 8, 300, 132) == 1  # too short to split
    assert choose_splits(8, 8, 4096, 132) == 5


def test_bad_shapes_are_named():
    cache, tables, gen = filled_cache(2, [4], seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode(torch.randn(1, 6, D + 1), cache.keys, cache.values, padded(tables, 2), torch.tensor([4]), 1.0)

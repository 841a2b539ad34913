"""A request's KV blocks move from one paged cache into another's freshly allocated blocks."""
from __future__ import annotations

import pytest
import torch

from services.gpu_worker.engine.kv_cache import PagedKVCache
from services.gpu_worker.engine.model_config import ModelConfig, RopeConfig
from services.gpu_worker.transfer import ChunkingConfig, DataPlane, DataPlaneConfig, TrafficClass
from services.gpu_worker.transfer.kv_blocks import block_runs, kv_block_views, kv_stream_bytes

pytestmark = pytest.mark.timeout(120)

BS = 16


def cache(max_blocks: int) -> PagedKVCache:
    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=10, hidden_size=64,
                      intermediate_size=8, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                      rms_norm_eps=1e-6, max_position=512, rope=RopeConfig(), qkv_bias=False,
                      tie_word_embeddings=False, dtype=torch.bfloat16)
    return PagedKVCache(cfg, max_blocks=max_blocks, block_size=BS)


def test_block_runs() -> None:
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 6), (9, 11), (2, 3)]
    assert block_runs([]) == []


async def test_kv_blocks_land_in_the_destination_cache_blocks() -> None:
    src, dst = cache(64), cache(64)
    tokens = 3 * BS + 5  # the last block is partly filled
    src_tables = {0: [10, 11, 12, 40], 2: [7, 3, 4, 5]}  # runs and scattered ids
    dst_tables = {0: [0, 1, 2, 3], 2: [20, 30, 31, 32]}  # other ids, same shape
    for layer, table in src_tables.items():
        src.import_tokens(table, torch.randn(2, tokens, 2, 32, dtype=torch.bfloat16))
    assert kv_stream_bytes(src, src_tables) == kv_stream_bytes(dst, dst_tables) == 2 * 4 * 2 * src.block_bytes // 2
    chunking = ChunkingConfig(min_chunk=8192, max_chunk=8192)  # chunks span block runs: scatter path too
    receiver = await DataPlane("dst", config=DataPlaneConfig(chunking=chunking)).start()
    sender = DataPlane("src", config=DataPlaneConfig(chunking=chunking))
    try:
        link = await sender.link("dst", receiver.address)
        # pre-copy: the full blocks first, then the tail block in the "final stop"
        for first, last, key in ((0, 3, "kv:req-1:stage-0"), (3, None, "kv:req-1:final")):
            sink = receiver.inbox.expect(key, kv_block_views(dst, dst_tables, first, last))
            await link.send(kv_block_views(src, src_tables, first, last), kind=TrafficClass.KV, key=key, timeout=60)
            await sink.wait(10)
        for layer in src_tables:
            assert torch.equal(src.export_tokens(src_tables[layer], tokens), dst.export_tokens(dst_tables[layer], tokens))
        untouched = dst.keys[50:60]
        assert not untouched.abs().sum()  # nothing written outside the destination blocks
    finally:
        await sender.close()
        await receiver.close()

"""KunServe's hooks: the model split at any layer across two runners (each with only its
layers' weights and KV), with chosen layers' attention on a third object that holds only
that layer's KV — same greedy tokens, logits within 1e-5 of the monolithic run (fp32)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.gpu_worker.engine.attention import PagedAttention
from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model
from services.gpu_worker.engine.greedy_driver import GreedyDriver, RemoteKV
from services.gpu_worker.engine.kv_cache import PagedKVCache, kv_block_bytes
from services.gpu_worker.engine.memory_pool import MemoryPool
from services.gpu_worker.engine.model_config import load_model_config
from services.gpu_worker.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py


LAYERS = 4
PROMPT_LENS = [3, 18, 35]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("split")
    base = make_model(root / "base", arch="qwen2", layers=LAYERS, hidden=64, heads=4, kv_heads=2, seed=9)
    make_lora(root / "lora", base, rank=4, targets=["q", "o", "down"], seed=4)
    return base


def fill(driver: GreedyDriver, vocab: int) -> None:
    g = torch.Generator().manual_seed(2)
    for i, n in enumerate(PROMPT_LENS):
        driver.add(f"s{i}", torch.randint(0, vocab, (n,), generator=g).tolist(), "ad" if i == 1 else None)


def stage(model_dir: Path, layers: range, remote_layers: set[int], lora: Path) -> tuple[ModelRunner, BlockManager]:
    pool = MemoryPool(16 << 20)
    runner = ModelRunner(model_dir, pool, layers=layers, kv_layers=[l for l in layers if l not in remote_layers])
    runner.lora.register("ad", lora)
    # The test's block manager covers the whole stage range; blocks of remote layers stay unused.
    return runner, BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes, layers=layers)


def kv_holder(model_dir: Path, layer: int) -> RemoteKV:
    """The third object: only `layer`'s KV (its own storage and block manager), no weights."""
    cfg = load_model_config(model_dir)
    pool = MemoryPool(4 << 20)
    block_bytes = kv_block_bytes(cfg, 16)
    cache = PagedKVCache(cfg, pool.capacity_bytes // block_bytes, 16)
    blocks = BlockManager(pool, block_size=16, block_bytes=block_bytes, layers=range(layer, layer + 1))
    return RemoteKV(PagedAttention(cache, [layer], cfg.sliding_window), blocks)


@pytest.fixture(scope="module")
def monolithic(model_dir):
    lora = model_dir.parent / "lora"
    runner, blocks = stage(model_dir, range(LAYERS), set(), lora)
    driver = GreedyDriver([(runner, blocks)])
    fill(driver, runner.cfg.vocab_size)
    driver.generate(NEW_TOKENS)
    return driver.seqs


@pytest.mark.parametrize("split", range(1, LAYERS))
def test_two_stage_pipeline_with_remote_attention_matches_monolithic(model_dir, monolithic, split):
    lora = model_dir.parent / "lora"
    remote_layers = {split - 1, split}  # last layer of stage 1 and first of stage 2
    first = stage(model_dir, range(0, split), remote_layers, lora)
    second = stage(model_dir, range(split, LAYERS), remote_layers, lora)
    holders = {layer: kv_holder(model_dir, layer) for layer in remote_layers}
    assert first[0].resident_layers() == list(range(split)) and first[0].model.lm_head is None
    assert second[0].resident_layers() == list(range(split, LAYERS)) and second[0].model.embed is None
    driver = GreedyDriver([first, second], remote=holders)
    fill(driver, first[0].cfg.vocab_size)
    driver.generate(NEW_TOKENS)
    for seq_id, ref in monolithic.items():
        got = driver.seqs[seq_id]
        assert got.output == ref.output, f"split {split}: {seq_id} tokens differ"
        diff = (torch.stack(got.logits) - torch.stack(ref.logits)).abs().max().item()
        assert diff <= 1e-5, f"split {split}: {seq_id} logits differ by {diff:.2e}"
    # the remote layers' KV really lives on the holders: the stages never wrote it
    for layer, holder in holders.items():
        used = [b for s in driver.seqs for b in holder.blocks.block_tables(s)[layer]]
        assert holder.attention.cache.keys[used].abs().sum() > 0
        runner, blocks = first if layer < split else second
        unused = [b for s in driver.seqs for b in blocks.block_tables(s)[layer]]
        assert runner.kv_cache.keys[unused].abs().sum() == 0


def test_stage_without_embedding_needs_hidden_states(model_dir):
    runner, blocks = stage(model_dir, range(2, LAYERS), set(), model_dir.parent / "lora")
    driver = GreedyDriver([(runner, blocks)])
    driver.add("x", [1, 2, 3])
    with pytest.raises(ValueError, match="needs hidden states for 3 tokens"):
        driver.step()

"""Residency: dropped weights become KV blocks in the same step (no KV copied), restored
weights give identical outputs; a request's KV moves to a fresh runner and continues
identically; the KV region is reserved, not backed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_ext.memory import reserve_region
from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.checkpoint_gen import make_model
from services.gpu_worker.engine.greedy_driver import GreedyDriver
from services.gpu_worker.engine.memory_pool import MemoryPool, PoolExhausted
from services.gpu_worker.engine.model_runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engine/conftest.py


LAYERS, SPLIT = 4, 2
PROMPT, NEW = 40, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # wide MLP so weights are worth many KV blocks
    return make_model(tmp_path_factory.mktemp("res"), layers=LAYERS, hidden=64, heads=4, kv_heads=2,
                      intermediate=512, vocab=512, seed=7)


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (PROMPT,), generator=g).tolist() for _ in range(n)]


def reference(model_dir: Path, batch: list[list[int]]) -> dict[str, list[int]]:
    pool = MemoryPool(64 << 20)
    runner = ModelRunner(model_dir, pool)
    driver = GreedyDriver([(runner, BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes,
                                                 layers=runner.layers))])
    for i, p in enumerate(batch):
        driver.add(f"r{i}", p)
    return driver.generate(NEW)


def test_drop_serve_more_restore_identical(model_dir):
    weights_only = ModelRunner(model_dir, MemoryPool(1 << 30))
    weights = weights_only.pool.breakdown()["weights"]
    pool = MemoryPool(weights + 48 * weights_only.kv_block_bytes)  # room for 48 KV blocks
    runner = ModelRunner(model_dir, pool)
    blocks = BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes, layers=runner.layers)
    storage = runner.kv_cache.blocks.data_ptr()
    per_seq = LAYERS * -(-(PROMPT + NEW) // 16)  # blocks a sequence needs on all layers
    n_before = blocks.num_blocks // per_seq
    n_after = n_before + 2
    assert blocks.num_blocks < n_after * per_seq, "the test load must not fit before the drop"

    released = runner.drop_layers(SPLIT, LAYERS)
    gained = blocks.sync_with_pool()  # the engine calls this every step
    assert released > 0 and gained == released // runner.kv_block_bytes
    assert runner.kv_cache.blocks.data_ptr() == storage  # same region: nothing moved
    assert pool.breakdown()["weights"] == weights - released

    # Serve through a buddy holding the dropped layers (KunServe pipeline): this runner now
    # keeps KV for its own layers only, so each request costs fewer of its blocks too.
    blocks.set_layers(range(0, SPLIT))
    runner.set_kv_layers(range(0, SPLIT))
    assert runner.stage == range(0, SPLIT) and not runner.is_last
    buddy_pool = MemoryPool(64 << 20)
    buddy = ModelRunner(model_dir, buddy_pool, layers=range(SPLIT, LAYERS))
    buddy_blocks = BlockManager(buddy_pool, block_size=16, block_bytes=buddy.kv_block_bytes, layers=buddy.layers)
    batch = prompts(n_after, runner.cfg.vocab_size)
    driver = GreedyDriver([(runner, blocks), (buddy, buddy_blocks)])
    for i, p in enumerate(batch):
        driver.add(f"r{i}", p)
    assert driver.generate(NEW) == reference(model_dir, batch)
    for seq_id in list(driver.seqs):
        driver.free(seq_id)

    # Restore: the pool reclaims free KV blocks for the weights; outputs are identical to
    # a runner that never dropped anything.
    blocks.set_layers(range(LAYERS))
    runner.set_kv_layers(range(LAYERS))
    runner.restore_layers(SPLIT, LAYERS)
    assert pool.breakdown()["weights"] == weights
    assert blocks.num_blocks == 48 and runner.resident_layers() == list(range(LAYERS))
    small = batch[:n_before]
    alone = GreedyDriver([(runner, blocks)])
    for i, p in enumerate(small):
        alone.add(f"r{i}", p)
    assert alone.generate(NEW) == reference(model_dir, small)


def test_restore_is_refused_while_live_kv_holds_the_bytes(model_dir):
    pool = MemoryPool(32 << 20)
    runner = ModelRunner(model_dir, pool)
    blocks = BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes, layers=runner.layers)
    runner.drop_layers(SPLIT, LAYERS)
    blocks.sync_with_pool()
    hog_tokens = blocks.num_blocks // LAYERS * 16  # live KV on every block
    assert blocks.allocate("hog", hog_tokens)
    with pytest.raises(PoolExhausted):
        runner.restore_layers(SPLIT, LAYERS)
    assert sorted(runner._host_layers) == list(range(SPLIT, LAYERS))  # host copies kept
    blocks.free("hog")
    runner.restore_layers(SPLIT, LAYERS)  # the pool reclaims the now free blocks
    assert runner.resident_layers() == list(range(LAYERS)) and not runner._host_layers


def test_restore_without_host_copy_rereads_checkpoint(model_dir):
    pool = MemoryPool(32 << 20)
    runner = ModelRunner(model_dir, pool, keep_host_copy=False)
    blocks = BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes, layers=runner.layers)
    prompt = prompts(1, runner.cfg.vocab_size)[0]
    runner.drop_layers(1, 2)
    assert 1 not in runner.model.layers and not runner._host_layers
    driver = GreedyDriver([(runner, blocks)])
    driver.add("x", prompt)
    with pytest.raises(RuntimeError, match=r"resident layers \[0, 2, 3\] are not contiguous"):
        driver.step()
    runner.restore_layers(1, 2)
    driver.free("x")
    driver.add("x", prompt)
    assert driver.generate(NEW)["x"] == reference(model_dir, [prompt])["r0"]


def test_kv_export_import_into_fresh_runner_continues_identically(model_dir):
    def fresh():
        pool = MemoryPool(32 << 20)
        runner = ModelRunner(model_dir, pool)
        return runner, BlockManager(pool, block_size=16, block_bytes=runner.kv_block_bytes, layers=runner.layers)

    src, src_blocks = fresh()
    driver = GreedyDriver([(src, src_blocks)])
    prompt = prompts(1, src.cfg.vocab_size)[0]
    driver.add("m", prompt)
    driver.generate(5)
    seq = driver.seqs["m"]
    data = src.export_kv(src_blocks.export_tables("m", src.layers), seq.computed)
    assert set(data) == set(range(LAYERS)) and data[0].shape == (2, seq.computed, 2, 16)

    dst, dst_blocks = fresh()
    dst_blocks.allocate("warm-up", 100)  # the destination's blocks differ from the source's
    tables = dst_blocks.import_tables("m", dst.layers, seq.computed)
    dst.import_kv(tables, data)
    moved = GreedyDriver([(dst, dst_blocks)])
    moved.add("m", prompt)
    moved.seqs["m"].tokens = list(seq.tokens)
    moved.seqs["m"].computed = seq.computed
    assert moved.generate(NEW) == driver.generate(NEW)
    assert tables[0] != src_blocks.block_tables("m")[0]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_kv_region_is_reserved_not_backed():
    before = _rss()
    region = reserve_region(4 << 30)  # 4 GiB of address space
    view = region.as_tensor(torch.float32, (1 << 20, 1024))
    assert _rss() - before < 64 << 20
    view[:256].fill_(1.0)  # touch 1 MiB
    assert region.resident_bytes() >= 1 << 20
    region.release(0, 256 * 4096)
    assert region.resident_bytes() < 1 << 20 and view[0, 0].item() == 0.0

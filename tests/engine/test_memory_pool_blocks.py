"""Memory pool accounting and the per-layer KV block manager (pure Python)."""
from __future__ import annotations

import pytest

from services.gpu_worker.engine.block_manager import BlockManager, BlockManagerError
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool, PoolExhausted

BLOCK = 100  # bytes per block (one layer's K+V for block_size tokens)


def make(capacity: int = 10_000, layers: range = range(4), block_size: int = 4) -> tuple[MemoryPool, BlockManager]:
    pool = MemoryPool(capacity)
    return pool, BlockManager(pool, block_size=block_size, block_bytes=BLOCK, layers=layers, owner="m")


def test_pool_charges_by_kind_and_owner_and_refuses_overflow() -> None:
    pool = MemoryPool(1000)
    w0 = pool.charge("weights", "m/layer.0", 300)
    pool.charge(MemoryKind.LORA, "sql-r8", 200)
    pool.charge(MemoryKind.WORKSPACE, "runner", 100)
    assert pool.breakdown() == {"weights": 300, "prewarm": 0, "lora": 200, "kv": 0, "workspace": 100, "free": 400}
    assert pool.by_owner()["lora"] == {"sql-r8": 200}
    with pytest.raises(PoolExhausted, match="cannot charge 500 B to prewarm/other"):
        pool.charge("prewarm", "other", 500)
    assert pool.release(w0) == 300
    assert pool.free_bytes == 700
    with pytest.raises(KeyError):
        pool.release(w0)
    with pytest.raises(ValueError):
        pool.charge("bogus-kind", "x", 1)


def test_kv_takes_what_is_left_and_grows_when_weights_are_dropped() -> None:
    pool = MemoryPool(2000)
    layer_weights = [pool.charge("weights", f"m/layer.{i}", 250) for i in range(4)]
    bm = BlockManager(pool, block_size=4, block_bytes=BLOCK, layers=range(4))
    assert bm.num_blocks == 10 and pool.free_bytes == 0
    assert pool.breakdown()["kv"] == 1000
    pool.release(layer_weights[2])
    pool.release(layer_weights[3])
    assert bm.sync_with_pool() == 5  # the freed bytes are blocks at the next step
    assert bm.num_blocks == 15 and bm.num_free_blocks == 15
    assert pool.breakdown()["kv"] == 1500 and pool.breakdown()["weights"] == 500


def test_restore_takes_back_only_free_blocks() -> None:
    pool = MemoryPool(1000)
    bm = BlockManager(pool, block_size=4, block_bytes=BLOCK, layers=range(2))
    assert bm.num_blocks == 10
    assert bm.allocate("a", 4 * 4)  # 4 blocks per layer x 2 layers = 8 blocks in use
    assert bm.num_free_blocks == 2
    pool.charge("weights", "m/layer.1", 200)  # reclaims the 2 free blocks
    assert bm.num_blocks == 8 and bm.num_free_blocks == 0
    with pytest.raises(PoolExhausted):
        pool.charge("weights", "m/layer.2", 100)  # live KV is never given up
    assert bm.num_used_blocks == 8
    bm.free("a")
    h = pool.charge("weights", "m/layer.2", 300)  # now free blocks can go
    assert pool.nbytes(h) == 300 and bm.num_blocks == 5
    # block ids stay below the storage limit, and retired ids are reused first
    assert bm.block_id_limit <= 10
    assert bm.allocate("b", 4 * 2)
    assert max(max(t) for t in bm.block_tables("b").values()) < bm.block_id_limit


def test_allocation_is_per_layer_and_atomic() -> None:
    pool, bm = make(capacity=1000, layers=range(3), block_size=4)
    assert bm.num_blocks == 10
    assert bm.allocate("a", 5)  # 2 blocks per layer
    tables = bm.block_tables("a")
    assert set(tables) == {0, 1, 2} and all(len(t) == 2 for t in tables.values())
    ids = [b for t in tables.values() for b in t]
    assert len(set(ids)) == 6  # no block shared between layers
    assert bm.allocate("a", 8) and bm.num_used_blocks == 6  # still fits in 2 blocks
    assert not bm.allocate("b", 9)  # needs 3 x 3 = 9 > 4 free: nothing allocated
    assert bm.num_used_blocks == 6 and not bm.has("b")
    assert bm.allocate("b", 4)
    assert bm.free("a") == 6 and bm.num_used_blocks == 3


def test_layer_range_change_export_import() -> None:
    pool, bm = make(capacity=3000, layers=range(4), block_size=4)
    assert bm.allocate("a", 10)  # 3 blocks per layer
    exported = bm.export_tables("a", range(2, 4))
    assert set(exported) == {2, 3} and all(len(t) == 3 for t in exported.values())
    used = bm.num_used_blocks
    bm.set_layers(range(0, 2))  # layers 2, 3 go to a peer: their blocks are free at once
    assert bm.num_used_blocks == used - 6
    assert set(bm.block_tables("a")) == {0, 1}
    with pytest.raises(BlockManagerError):
        bm.export_tables("a", range(2, 3))
    bm.set_layers(range(0, 4))  # layers come back: empty tables, to be imported
    assert bm.block_tables("a")[3] == []
    imported = bm.import_tables("a", range(2, 4), 10)
    assert imported is not None and all(len(t) == 3 for t in imported.values())
    assert bm.blocks_needed("a", 10) == 0
    assert bm.release_layers("a", range(3, 4)) == 3
    assert bm.blocks_needed("a", 10) == 3


def test_give_back_retires_highest_free_ids() -> None:
    pool, bm = make(capacity=1000, layers=range(1), block_size=4)
    assert bm.allocate("a", 8)  # the two lowest ids
    assert sorted(bm.block_tables("a")[0]) == [0, 1]
    assert bm.give_back(300) == 300
    assert bm.num_blocks == 7 and bm.block_id_limit == 7
    assert pool.free_bytes == 300


def contiguous(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_chains_stay_contiguous_while_there_is_room_and_degrade_gracefully() -> None:
    pool, bm = make(capacity=400 * BLOCK, layers=range(2), block_size=4)
    for step in range(1, 41):  # 4 sequences growing in lockstep, each expecting 160 tokens
        for s in "abcd":
            assert bm.allocate(s, step * 4, expected_tokens=160)
    for s in "abcd":
        assert all(len(t) == 40 and contiguous(t) for t in bm.block_tables(s).values())
    # Under pressure reservations give way: every free block is still usable.
    free = bm.num_free_blocks
    assert bm.allocate("big", free // 2 * 4, expected_tokens=free // 2 * 4)
    assert bm.num_free_blocks == free % 2
    assert bm.free("a") == 80 and bm.allocate("e", 8 * 4, expected_tokens=400)
    assert all(contiguous(t) for t in bm.block_tables("e").values())  # reuses a's runs


def test_reservations_cut_by_give_back_are_harmless() -> None:
    pool, bm = make(capacity=100 * BLOCK, layers=range(1), block_size=4)
    assert bm.allocate("a", 4, expected_tokens=400)  # block 0, the rest of the id space reserved
    assert bm.give_back(90 * BLOCK) == 90 * BLOCK  # the highest ids go, reserved or not
    assert bm.block_id_limit == 10
    assert bm.allocate("a", 40, expected_tokens=400)  # grows in place up to the new limit
    assert bm.block_tables("a")[0] == list(range(10))
    assert bm.free("a") == 10 and bm.num_free_blocks == 10
    assert bm.allocate("b", 40) and bm.num_free_blocks == 0


def test_every_block_handed_out_was_announced_to_on_grow_first() -> None:
    """The CUDA VMM region maps memory only behind ids announced by `on_grow`; a block handed
    out before its announcement would be a fatal device fault there."""
    pool = MemoryPool(2000)
    grown: list[int] = []
    retired: list[int] = []
    bm = BlockManager(pool, block_size=4, block_bytes=BLOCK, layers=range(2), on_grow=grown.extend,
                      on_retire=retired.extend)
    assert sorted(grown) == list(range(bm.num_blocks))
    weights = pool.charge("weights", "other", 1500)  # the pool takes blocks back (retire)
    assert retired and bm.num_blocks == 20 - len(retired)
    pool.release(weights)
    before = len(grown)
    bm.sync_with_pool()
    regrown = grown[before:]
    assert sorted(regrown) == sorted(retired)  # retired ids come back first, and are announced again
    live = (set(grown[:before]) - set(retired)) | set(regrown)
    assert bm.allocate("r", 8 * 4)
    taken = {b for table in bm.block_tables("r").values() for b in table}
    assert taken and taken <= live

"""A grace-period instance's KV cap (WarmServe Eq. 1, `BlockManager.set_cap`), pure Python: its free
blocks above the cap go back to the pool at once, live ones stay, and it claims no block past the cap."""
from __future__ import annotations

from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool

BLOCK = 100


def test_the_cap_returns_free_blocks_and_stops_growth_until_lifted() -> None:
    pool = MemoryPool(40 * BLOCK)
    bm = BlockManager(pool.view("i"), block_size=4, block_bytes=BLOCK, layers=range(2), claim_batch=2, floor_blocks=2)
    assert bm.num_blocks == 40 and pool.free_bytes == 0
    assert bm.allocate("s1", 20)  # 5 blocks per layer: 10 live blocks
    given = bm.set_cap(16 * BLOCK)
    assert given == 24 * BLOCK and bm.num_blocks == 16 and pool.free_bytes == 24 * BLOCK  # room for a prewarm
    assert bm.capacity_blocks == 16 and pool.bytes_of(MemoryKind.KV) == 16 * BLOCK
    assert bm.allocate("s1", 32)  # 8 per layer: 16 blocks, exactly the cap
    assert not bm.allocate("s2", 4)  # past the cap: refused although the pool has free bytes
    assert bm.num_blocks == 16 and pool.free_bytes == 24 * BLOCK
    # a cap below the live blocks keeps them (never live KV is dropped)
    assert bm.set_cap(4 * BLOCK) == 0 and bm.num_blocks == 16
    bm.set_cap(None)
    assert bm.allocate("s2", 4) and bm.num_blocks > 16

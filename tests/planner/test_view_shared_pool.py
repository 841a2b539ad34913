"""A worker's KV capacity in the planner's view counts its one shared pool once, however many instances."""
from __future__ import annotations

from shared.events.common import LayerRange
from shared.events.worker import InstanceStats, PoolBreakdown, WorkerStats
from shared.planner.view import worker_view

BLOCK = 4096


def _stats() -> WorkerStats:
    # 100 blocks of KV reserved + 50 free in the pool; each instance alone could reach all 150
    pool = PoolBreakdown(capacity_bytes=1000 * BLOCK, weights_bytes=850 * BLOCK, kv_bytes=100 * BLOCK,
                         free_bytes=50 * BLOCK)
    insts = [InstanceStats(instance_id=f"i{n}", model=f"m{n}", layers=LayerRange(start=0, end=4),
                           kv_blocks_total=150, kv_blocks_used=used, kv_block_bytes=BLOCK,
                           kv_used_bytes=used * BLOCK)
             for n, used in ((0, 60), (1, 30))]
    return WorkerStats(worker_id="w0", seq=1, ts=1.0, device="cpu", state="ready", pool=pool, instances=insts)


def test_capacity_is_the_pool_kv_plus_free_not_the_sum_of_instances():
    view = worker_view(_stats())
    assert view.kv_capacity_bytes == 150 * BLOCK  # not 300 blocks: the shared KV counted twice
    assert view.kv_used_bytes == 90 * BLOCK
    assert abs(view.kv_usage - 90 / 150) < 1e-9

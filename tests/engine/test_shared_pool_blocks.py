"""Two block managers on one memory pool (pure Python): claims, reclaims, floors, wants."""
from __future__ import annotations

import threading

from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool

BLOCK = 100  # bytes per block
LAYERS = range(2)


def manager(pool: MemoryPool, tenant: str, retired: list[int] | None = None, **kw: int) -> BlockManager:
    return BlockManager(pool.view(tenant), block_size=4, block_bytes=BLOCK, layers=LAYERS, owner=f"{tenant}:kv",
                        claim_batch=kw.get("claim_batch", 2), floor_blocks=kw.get("floor_blocks", 4),
                        on_retire=None if retired is None else retired.extend)


def kv(pool: MemoryPool, tenant: str) -> int:
    return pool.bytes_of(MemoryKind.KV, tenant=tenant)


def test_charges_are_per_tenant_and_the_totals_are_the_pools() -> None:
    pool = MemoryPool(10_000)
    a, b = pool.view("a"), pool.view("b")
    a.charge("weights", "m:layer0", 1000)
    b.charge("weights", "m:layer0", 2000)
    b.charge("lora", "lora:x", 500)
    assert a.breakdown()["weights"] == 1000 and b.breakdown()["weights"] == 2000
    assert a.breakdown()["free"] == b.free_bytes == pool.free_bytes == 6500
    assert b.by_owner() == {"weights": {"m:layer0": 2000}, "lora": {"lora:x": 500}}
    assert a.bytes_of("weights", "m:layer0") == 1000 and pool.bytes_of("weights") == 3000


def test_an_idle_instances_free_blocks_become_the_busy_ones() -> None:
    pool = MemoryPool(40 * BLOCK)
    a = manager(pool, "a")  # the first takes what is free: "KV takes what is left"
    b = manager(pool, "b")
    assert a.num_blocks == 40 and b.num_blocks == 0 and pool.free_bytes == 0
    assert b.capacity_blocks == 40  # what b could hold: judged for "fits at all", not num_blocks
    assert b.allocate("s", 4 * 6)  # 6 blocks per layer: taken from a, which is idle (no floor)
    assert b.num_blocks == 12 and a.num_blocks == 28
    assert kv(pool, "a") + kv(pool, "b") == 40 * BLOCK
    assert b.free("s") == 12 and b.num_free_blocks == 12  # kept until someone needs them


def test_a_busy_instance_keeps_its_floor_and_never_gives_live_blocks() -> None:
    pool = MemoryPool(40 * BLOCK)
    retired: list[int] = []
    a, b = manager(pool, "a", retired), manager(pool, "b")
    assert a.allocate("live", 4 * 15)  # 30 live blocks, 10 free
    live = {blk for t in a.block_tables("live").values() for blk in t}
    assert b.allocate("s", 4 * 3)  # 6 blocks: from a's free, above its floor of 4
    assert a.num_free_blocks == 4 and b.num_blocks == 6
    assert not b.allocate("s", 4 * 5)  # 4 more: only a's floor and live blocks are left
    assert a.num_blocks_of("live") == 30 and a.num_free_blocks == 4 and not live & set(retired)
    a.free("live")  # idle now: nothing is kept from others
    assert b.allocate("s", 4 * 5) and b.num_blocks == 10 and a.num_blocks == 30


def test_a_want_earmarks_blocks_freed_elsewhere_for_the_instance_that_waits() -> None:
    pool = MemoryPool(20 * BLOCK)
    a, b = manager(pool, "a", floor_blocks=0), manager(pool, "b")
    assert a.allocate("x", 4 * 5) and a.allocate("y", 4 * 5)  # a's 20 blocks are all live
    assert not b.allocate("s", 4 * 4)  # needs 8
    b.settle()  # end of b's step: the 8 blocks become b's want
    a.free("x")  # 10 free blocks at a
    assert a.sync_with_pool() == 0  # a's next step: it gives 8 back for b, claims none of them
    assert a.num_blocks == 12 and pool.free_bytes == 8 * BLOCK
    assert not a.allocate("z", 4 * 6)  # 12 blocks: the 8 free bytes are b's, not a's
    assert b.allocate("s", 4 * 4) and b.num_blocks == 8
    b.settle()  # satisfied: the want is withdrawn
    assert pool.available_to("a") == pool.free_bytes


def test_other_kinds_reclaim_free_kv_of_every_tenant_floors_last() -> None:
    pool = MemoryPool(30 * BLOCK)
    a, b = manager(pool, "a"), manager(pool, "b")
    assert b.allocate("s", 4 * 5) and a.allocate("t", 4 * 5)  # b: 10 live + 2 free (batch); a the rest
    pool.view("b").charge("lora", "lora:x", 10 * BLOCK)  # free KV of both goes, floors kept while it can
    assert a.num_used_blocks == 10 and b.num_used_blocks == 10
    assert pool.free_bytes >= 0 and kv(pool, "a") + kv(pool, "b") + 10 * BLOCK + pool.free_bytes == 30 * BLOCK


def test_two_threads_claiming_and_freeing_keep_the_accounting_exact() -> None:
    pool = MemoryPool(64 * BLOCK)
    managers = [manager(pool, "a"), manager(pool, "b")]
    errors: list[BaseException] = []

    def churn(bm: BlockManager, tag: str) -> None:
        try:
            for i in range(400):
                sid = f"{tag}{i % 5}"
                if bm.has(sid) and i % 3 == 0:
                    bm.free(sid)
                elif bm.allocate(sid, 4 * (1 + i % 7)):
                    assert len({blk for t in bm.block_tables(sid).values() for blk in t}) == bm.num_blocks_of(sid)
                bm.settle()
                bm.sync_with_pool()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(bm, tag)) for bm, tag in zip(managers, "ab")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for bm, tag in zip(managers, "ab"):
        assert kv(pool, tag) == bm.num_blocks * BLOCK
        held = sum(bm.num_blocks_of(f"{tag}{i}") for i in range(5))
        assert bm.num_used_blocks == held and bm.num_free_blocks == bm.num_blocks - held
    assert pool.used_bytes + pool.free_bytes == 64 * BLOCK and pool.used_bytes == sum(kv(pool, t) for t in "ab")

"""PrefixCache through the block manager (pure: no torch): sharing by refcount, cached-free LRU,
eviction on demand and by `evict(n)`, and invariants under random operations (hypothesis)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.sequence import Sequence
from shared.prefix_hash import block_hashes, prefix_salt

BS = 4
BB = 64  # bytes per block
LAYERS = (0, 1)


def manager(blocks: int = 64, *, pool_bytes: int | None = None) -> BlockManager:
    pool = MemoryPool(pool_bytes if pool_bytes is not None else blocks * BB)
    return BlockManager(pool, block_size=BS, block_bytes=BB, layers=LAYERS, max_blocks=blocks, prefix_model="m",
                        claim_batch=1, floor_blocks=0)


def seq(sid: str, tokens: list[int], adapter: str | None = None) -> Sequence:
    return Sequence(sid, list(tokens), SamplingParams(), 0.0, 0, adapter=adapter)


def run(bm: BlockManager, s: Sequence) -> int:
    """Admit and compute a sequence's whole prompt as the scheduler would; returns blocks hit."""
    _, hit = bm.attach_prefix(s)
    s.num_computed_tokens = hit * BS
    assert bm.allocate(s.seq_id, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_prefix(s)
    return hit


def test_a_shared_prefix_is_held_once_and_outlives_its_users() -> None:
    bm = manager()
    cache = bm.prefix
    a = seq("a", list(range(13)))  # 3 full blocks + 1 token
    assert run(bm, a) == 0
    assert cache.held_hashes() == list(reversed(block_hashes(a.prompt_token_ids, BS, prefix_salt("m"))))
    used_a = bm.num_used_blocks
    b = seq("b", list(range(12)) + [99, 98])  # shares 3 full blocks
    assert run(bm, b) == 3
    assert bm.block_tables("b")[0][:3] == bm.block_tables("a")[0][:3]
    assert bm.block_tables("b")[1][:3] == bm.block_tables("a")[1][:3]
    assert bm.num_used_blocks == used_a + len(LAYERS)  # b's own: its last block on each layer
    bm.free("a")
    assert cache.cached_free_blocks() == 0  # b still uses every entry
    bm.free("b")
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == cache.cached_free_kv_blocks == cache.cached_free_blocks() * len(LAYERS)
    # a fully cached prompt still computes its last token: the hit stops one block short
    c = seq("c", list(range(12)))
    assert run(bm, c) == 2


def test_lru_evicts_the_oldest_tail_first_and_evict_n_counts_entries() -> None:
    bm = manager()
    cache = bm.prefix
    old, new = seq("old", [1] * 8), seq("new", [2] * 8)
    run(bm, old)
    run(bm, new)
    bm.free("old")
    bm.free("new")
    h_old = block_hashes([1] * 8, BS, prefix_salt("m"))
    h_new = block_hashes([2] * 8, BS, prefix_salt("m"))
    free_before = bm.num_free_blocks
    assert cache.cached_free_blocks() == 4
    assert cache.evict(1) == 1
    assert h_old[1] not in cache.held_hashes() and h_old[0] in cache.held_hashes()  # the tail went first
    assert cache.evict(2) == 2
    assert cache.held_hashes() == [h_new[0]]
    assert cache.evict(5) == 1 and cache.evict(1) == 0
    assert bm.num_free_blocks == free_before  # cached-free blocks were counted as free all along
    assert bm.num_cached_blocks == 0


def test_allocation_and_the_pool_take_cached_free_blocks_before_refusing() -> None:
    bm = manager(blocks=16)
    run(bm, seq("a", list(range(32))))  # 8 token blocks x 2 layers: every block
    bm.free("a")
    assert bm.num_cached_blocks == 16 and bm.num_used_blocks == 0
    assert bm.allocate("b", 12)  # 6 blocks: the LRU entries are evicted for them
    assert bm.prefix.cached_free_blocks() == 5
    bm.free("b")
    # another kind's charge reclaims free KV, cached-free included
    bm.pool.charge(MemoryKind.WEIGHTS, "w", 12 * BB)
    assert bm.num_blocks == 4
    assert bm.num_used_blocks == 0


def test_allocation_grows_into_unused_pool_bytes_before_evicting_a_cached_prefix() -> None:
    bm = manager(blocks=64, pool_bytes=64 * BB)
    run(bm, seq("a", list(range(32))))  # 8 token blocks x 2 layers, grown as needed
    bm.free("a")
    held = list(bm.prefix.held_hashes())
    assert bm.give_back(10 * BB) == 10 * BB  # plain free blocks back to the pool: unused bytes
    assert bm.num_cached_blocks == 16
    while bm.num_free_blocks > bm.num_cached_blocks:  # spend the plain free blocks
        assert bm.allocate(f"fill{bm.num_used_blocks}", BS)
    assert bm.allocate("b", 12)  # the pool still has bytes: the cache is kept whole
    assert bm.prefix.held_hashes() == held and bm.num_cached_blocks == 16


def test_an_adapter_never_shares_with_the_base_and_stale_entries_are_not_hit() -> None:
    bm = manager()
    run(bm, seq("base", list(range(9))))
    assert run(bm, seq("lora", list(range(9)), adapter="x")) == 0
    assert run(bm, seq("lora2", list(range(9)), adapter="x")) == 2
    bm.prefix.invalidate("x", everything=False)
    assert run(bm, seq("lora3", list(range(9)), adapter="x")) == 0
    assert run(bm, seq("base2", list(range(9)))) == 2


def test_a_layer_change_makes_everything_stale_and_turns_sharing_off() -> None:
    bm = manager()
    run(bm, seq("a", list(range(9))))
    bm.free("a")
    bm.set_layers([0])
    assert bm.prefix.held_hashes() == [] and bm.num_cached_blocks == 0
    assert run(bm, seq("b", list(range(9)))) == 0 and bm.prefix.held_hashes() == []
    bm.set_layers(LAYERS)
    run(bm, seq("c", list(range(9))))
    assert run(bm, seq("d", list(range(9)))) == 2


# --- invariants under random operations ---------------------------------------------------
OPS = st.lists(st.tuples(st.sampled_from(["add", "free", "evict", "charge"]), st.integers(0, 7), st.integers(1, 20)),
               max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_refcounts_never_go_negative_and_live_blocks_are_never_evicted(ops) -> None:
    bm = manager(blocks=40)
    cache = bm.prefix
    live: dict[str, Sequence] = {}
    n = 0
    charges = []
    for op, k, length in ops:
        if op == "add":
            n += 1
            s = seq(f"s{n}", [k % 3] * 4 + list(range(length)))  # few distinct prefixes: many hits
            _, hit = bm.attach_prefix(s)
            s.num_computed_tokens = hit * BS
            if bm.allocate(s.seq_id, s.num_tokens):
                s.num_computed_tokens = s.num_tokens
                bm.commit_prefix(s)
                live[s.seq_id] = s
            elif hit:
                bm.free(s.seq_id)
        elif op == "free" and live:
            sid = sorted(live)[k % len(live)]
            bm.free(sid)
            del live[sid]
        elif op == "evict":
            cache.evict(k)
        elif op == "charge":
            try:
                charges.append(bm.pool.charge(MemoryKind.WEIGHTS, f"w{len(charges)}", length * BB))
            except MemoryError:
                pass
        # invariants
        in_use = {b for sid in live for t in bm.block_tables(sid).values() for b in t}
        assert all(e.refs >= 0 for e in cache._owner.values())
        assert all(e.refs == 0 for e in cache._free.values())
        assert all(not bm._alloc._free[b] for b in in_use)  # a block in use is never free
        cached_free = {b for e in cache._free.values() for b in e.blocks.values()}
        assert not in_use & cached_free  # nor sitting in the evictable pool
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
        assert bm.num_used_blocks == len(in_use)
    # every live table slot pointing at a cached block is counted by its entry, and nothing else is
    refs = sum(e.refs for e in set(cache._owner.values()))
    slots = sum(1 for sid in live for t in bm.block_tables(sid).values() for b in t if b in cache._owner)
    assert refs == slots


def test_a_sequence_running_when_its_adapter_is_invalidated_names_no_more_blocks() -> None:
    bm = manager()
    old = seq("old", list(range(9)), adapter="x")
    _, _ = bm.attach_prefix(old)
    assert bm.allocate("old", 9)
    old.num_computed_tokens = 4
    bm.commit_prefix(old)  # block 0 named under the old weights
    bm.prefix.invalidate("x", everything=False)
    old.num_computed_tokens = 9
    bm.commit_prefix(old)  # block 1 (chained on the stale block 0) must not be named
    assert bm.prefix.held_hashes() == []
    run(bm, seq("new", list(range(9)), adapter="x"))  # the re-registered adapter names both afresh
    assert run(bm, seq("new2", list(range(9)), adapter="x")) == 2

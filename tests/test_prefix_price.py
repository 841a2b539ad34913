"""Cached prefix blocks on the memory market (shared/policy/prefix_price.py, memory_market.buy's divisible
offers): worked prices, and the invariant that a colder cache is given up before a hotter one and before
any source dearer per byte."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from shared.policy.memory_market import Need, Offer, buy
from shared.policy.prefix_price import blocks_for, price_prefix_eviction, reuse_chance

PREFILL_S = 5e-4  # the `cpu` cost profile's prefill seconds per token
TOKEN_BYTES = 32 * 1024  # KV bytes per token (8 layers x 64 KiB per 16-token block)


def test_reuse_chance_is_the_recent_block_hit_rate_and_zero_without_lookups() -> None:
    assert reuse_chance(200, 50) == pytest.approx(0.25)
    assert reuse_chance(0, 0) == 0.0  # no look-ups: no evidence anyone reuses it
    assert reuse_chance(10, 12) == 1.0  # counters sampled a moment apart: capped
    with pytest.raises(ValueError, match=">= 0"):
        reuse_chance(-1, 0)


def test_the_price_is_the_chance_of_reuse_times_the_prefill_it_saves() -> None:
    # 1,280 tokens (40 MiB of KV) reused with chance 0.1: a request re-prefills them at 0.5 ms each
    assert price_prefix_eviction(0.1, 1280, PREFILL_S) == pytest.approx(0.1 * 1280 * 5e-4)  # 0.064 request-s
    assert price_prefix_eviction(0.0, 1280, PREFILL_S) == 0.0  # never hit: free to give up
    assert price_prefix_eviction(1.0, 1280, PREFILL_S) == pytest.approx(0.64)  # always hit: its whole prefill
    with pytest.raises(ValueError, match="chance"):
        price_prefix_eviction(1.5, 1, PREFILL_S)
    with pytest.raises(ValueError, match="tokens"):
        price_prefix_eviction(0.5, -1, PREFILL_S)


def test_blocks_for_covers_the_need_within_what_is_held() -> None:
    assert blocks_for(1000, 50, 100) == 10
    assert blocks_for(1001, 50, 100) == 11  # a part block is a whole block
    assert blocks_for(10_000, 50, 100) == 50  # never more than held
    assert blocks_for(1000, 0, 100) == 0 and blocks_for(0, 50, 100) == 0


def test_a_divisible_offer_is_bought_cut_to_what_is_missing_at_its_price_per_byte() -> None:
    need = Need("worker:w1", 1000, 10.0, 1, 0.0)  # waiting: 10 s for 1000 B, 0.01 request-s per byte
    cache = Offer("prefix", "w1/i1", 4000, 4.0, "cache", divisible=True)  # 0.001 per byte
    adapter = Offer("adapter", "w1/a", 4000, 4.0, "adapter")  # the same per byte, but bought whole
    p = buy(need, [adapter, cache])
    (got,) = p.bought
    assert got.source == "prefix" and got.bytes == 1000 and got.price == pytest.approx(1.0) and got.payload == "cache"
    assert p.covered and p.price == pytest.approx(1.0)
    # whole, the adapter would cost 4.0 for the 1000 B used: 0.004 per byte, still cheaper than waiting
    assert buy(need, [adapter]).bought == (adapter,)


def _prefix_offer(i: int, hit: float, nbytes: int) -> Offer:
    return Offer("prefix", f"w1/i{i}", nbytes, price_prefix_eviction(hit, nbytes // TOKEN_BYTES, PREFILL_S),
                 ("prefix", i, hit), divisible=True)


@st.composite
def markets(draw):  # type: ignore[no-untyped-def]
    caches = [_prefix_offer(i, draw(st.integers(0, 100)) / 100, draw(st.integers(1, 400)) * TOKEN_BYTES)
              for i in range(draw(st.integers(1, 4)))]
    others = [Offer(draw(st.sampled_from(["prewarm", "adapter", "layers", "migrate", "scale_out"])), f"x{i}",
                    draw(st.integers(1, 400)) * TOKEN_BYTES, draw(st.floats(0, 2)), ("other", i))
              for i in range(draw(st.integers(0, 4)))]
    need = Need("worker:w1", draw(st.integers(1, 800)) * TOKEN_BYTES, 10.0, draw(st.integers(1, 8)),
                draw(st.floats(0, 1e9)))
    return need, caches, others


@settings(max_examples=300, deadline=None)
@given(markets())
def test_a_colder_cache_goes_first_and_nothing_dearer_per_byte_while_a_cache_is_kept(market) -> None:  # type: ignore
    need, caches, others = market
    p = buy(need, caches + others)
    bought = {o.payload: o for o in p.bought}
    # a hotter cache is touched only once every colder one is given up whole
    for hot in caches:
        if hot.payload in bought:
            for cold in caches:
                if cold.payload[2] < hot.payload[2]:
                    assert cold.payload in bought and bought[cold.payload].bytes == cold.bytes
    # every purchase was at most as dear per byte it covered as any cache left untouched
    kept = [c for c in caches if c.payload not in bought]
    missing = need.bytes
    for o in p.bought:
        used = min(o.bytes, missing)
        for c in kept:
            assert o.price / used <= c.unit_price * (1 + 1e-9)
        missing -= o.bytes
    # a cache is never bought beyond what the need still missed
    assert p.bought_bytes - max((o.bytes for o in p.bought), default=0) < max(1, need.bytes)

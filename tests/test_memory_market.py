"""The memory market (shared/policy/memory_market.py): each price on a worked example, and buy's greedy
order — cheapest per useful byte, never dearer than waiting, stopping once the need is covered."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from shared.policy.memory_market import (
    Need, Offer, buy, drop_duration_s, drop_slowdown, need_duration_s, price_adapter_eviction, price_capacity_eviction, price_eviction,
    price_layer_drop, price_migration, price_prewarm_eviction, price_scale_out, queue_price,
)


def test_waiting_costs_each_waiting_request_until_the_scope_drains_or_the_horizon_ends() -> None:
    assert queue_price(Need("worker:w1", 1000, 10.0, 3, 200.0)) == pytest.approx(15.0)  # 1000 B / 200 B/s = 5 s
    # 20 s to drain: past the horizon, re-planned there (nothing on the market: 0 more)
    assert queue_price(Need("worker:w1", 1000, 10.0, 3, 50.0)) == pytest.approx(30.0)
    assert queue_price(Need("worker:w1", 1000, 10.0, 3, 50.0), later=12.0) == pytest.approx(42.0)
    assert queue_price(Need("worker:w1", 1000, 10.0, 3, 50.0), later=90.0) == pytest.approx(60.0)  # the full wait
    assert queue_price(Need("worker:w1", 1000, 10.0, 3, 0.0)) == pytest.approx(30.0)  # frees nothing by itself
    assert queue_price(Need("worker:w1", 0, 10.0, 3, 0.0)) == 0.0


def test_waiting_that_preempts_also_pays_the_recompute():
    # 2 waiting requests wait 5 s; 3 preempted ones wait as long and then re-prefill their context (0.4 s each)
    need = Need("worker:w1", 1000, 10.0, 2, 200.0, preempted=3, recompute_s=0.4)
    assert queue_price(need) == pytest.approx(2 * 5.0 + 3 * (5.0 + 0.4))
    with pytest.raises(ValueError, match="preempted"):
        Need("worker:w1", 1000, 10.0, 2, 200.0, preempted=-1)
    with pytest.raises(ValueError, match="horizon_s > 0"):
        Need("worker:w1", 10, 0.0, 1, 0.0)


def test_prewarm_eviction_costs_the_extra_cold_start_times_its_chance() -> None:
    # extra = 4 - 1 = 3 s; the first request waits 3 s and 2 req/s x 3 s arrive meanwhile, waiting 1.5 s each
    assert price_prewarm_eviction(0.5, 2.0, 4.0, 1.0) == pytest.approx(0.5 * 3 * (1 + 2 * 3 / 2))
    assert price_prewarm_eviction(0.0, 2.0, 4.0, 1.0) == 0.0  # surely not needed: free
    assert price_prewarm_eviction(1.0, 2.0, 1.0, 4.0) == 0.0  # a hit is no faster than cold
    with pytest.raises(ValueError, match="chance"):
        price_prewarm_eviction(1.5, 0.0, 1.0, 0.0)


def test_adapter_eviction_costs_its_next_cold_use_by_the_chance_it_comes_within_the_horizon() -> None:
    assert price_adapter_eviction(1.0, 2.0, 0.5) == pytest.approx((1 - math.exp(-2.0)) * 0.5)
    assert price_adapter_eviction(1.0, 2.0, 0.5, stalled=4) == pytest.approx((1 - math.exp(-2.0)) * 2.0)
    assert price_adapter_eviction(0.0, 2.0, 0.5) == 0.0  # nobody uses it
    with pytest.raises(ValueError, match="stalled >= 1"):
        price_adapter_eviction(1.0, 2.0, 0.5, stalled=0)


def test_layer_drop_costs_the_pipeline_overhead_of_every_running_request_until_restored() -> None:
    assert price_layer_drop(0.2, 10, 5.0, 1.0) == pytest.approx(0.2 * 10 * 6.0)
    assert price_layer_drop(0.0, 10, 5.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="slowdown"):
        price_layer_drop(-0.1, 1, 1.0, 0.0)


def test_a_drop_is_priced_from_the_slowdown_the_group_runs_at() -> None:
    # issue 32: a member runs at step time / efficiency; at efficiency 0.8 a step takes 1.25x, so 10 running
    # requests over 5 s + a 1 s restore lose 0.25 x 10 x 6 = 15 request-s (1 - eff charged 0.2: 12)
    assert drop_slowdown(0.8) == pytest.approx(0.25)
    assert drop_slowdown(1.0) == 0.0
    assert price_layer_drop(drop_slowdown(0.8), 10, 5.0, 1.0) == pytest.approx(15.0)
    with pytest.raises(ValueError, match="efficiency"):
        drop_slowdown(0.0)


def test_migration_and_scale_out_prices() -> None:
    assert price_migration(0.3, 0.2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        price_migration(-0.1)
    assert price_scale_out(2.0, 5) == pytest.approx(10.0)  # 5 waiting requests wait the 2 s start
    with pytest.raises(ValueError, match="eviction"):
        price_scale_out(2.0, 5, -1.0)


def test_a_start_that_evicts_a_replica_pays_the_same_price_as_evicting_it_alone() -> None:
    # issue 32: the start's GPU holds another model's replica (50% chance it is needed, 4 s cold vs 1 s hit,
    # 2 req/s). Evicting it costs 0.5 x 3 x (1 + 2 x 3 / 2) = 6 request-s whoever evicts it; the start
    # used to charge only 0.5 x 3 = 1.5 (the evicted model's arrivals left out)
    eviction = price_prewarm_eviction(0.5, 2.0, 4.0, 1.0)
    assert eviction == pytest.approx(6.0)
    assert price_scale_out(2.0, 5, eviction) == pytest.approx(5 * 2.0 + 6.0)


def test_buy_takes_the_cheapest_per_useful_byte_until_covered_and_never_dearer_than_waiting() -> None:
    need = Need("worker:w1", 1000, 10.0, 2, 0.0)  # frees nothing: 2 x 10 s, then re-planned
    prewarm = Offer("prewarm", "w1/p", 600, 1.0)  # 0.0017 a byte
    layers = Offer("layers", "w1+w2", 600, 6.0)  # 0.01 a byte
    migrate = Offer("migrate", "r1", 400, 2.0)  # 0.005 a byte
    scale = Offer("scale_out", "w3/m", 1000, 30.0)  # 0.03 a byte: dearer than waiting
    p = buy(need, [scale, layers, migrate, prewarm])
    assert p.offers == (prewarm, migrate, layers, scale)  # the price list, cheapest per byte first
    assert p.bought == (prewarm, migrate)  # 600 B, then the 400 B still missing at 2/400 < 6/400
    assert p.covered and p.bought_bytes == 1000 and p.price == pytest.approx(3.0)
    # waiting: the horizon's 20 request-s, then the same 3 request-s purchase at the re-plan
    assert p.reserve_unit_price == pytest.approx(0.023)


def test_waiting_and_a_start_are_on_one_horizon_rule() -> None:
    # issue 32: waiting was capped at the 10 s horizon and a start was not, so with 3 requests waiting on a
    # scope that frees nothing a 9.9 s start was bought and a 10.1 s one never. Now waiting past the
    # horizon costs the horizon plus the purchase at the re-plan: the start that lands is bought either way
    def start(s: float) -> Offer:
        return Offer("scale_out", "w3/m", 1000, price_scale_out(s, 3))

    for s in (9.9, 10.1, 25.0):
        assert buy(Need("model:m", 1000, 10.0, 3, 0.0), [start(s)]).bought == (start(s),)
    # a scope that drains its bytes in 5 s waits rather than start for 10.1 s (or 9.9 s) ...
    assert buy(Need("model:m", 1000, 10.0, 3, 200.0), [start(10.1)]).bought == ()
    assert buy(Need("model:m", 1000, 10.0, 3, 200.0), [start(9.9)]).bought == ()
    # ... and one that would drain in 20 s starts one for 10.1 s (was: the 20 s wait counted as 10)
    assert buy(Need("model:m", 1000, 10.0, 3, 50.0), [start(10.1)]).bought == (start(10.1),)
    assert buy(Need("model:m", 1000, 10.0, 3, 50.0), [start(25.0)]).bought == ()


def test_an_indivisible_need_is_bought_all_or_nothing() -> None:
    # issue 32: a 1 GiB prompt cannot start in 0.9 GiB; the cheap 0.9 GiB offer alone is not bought
    gib = 1 << 30
    need = Need("worker:w1", gib, 10.0, 1, 0.0, min_bytes=gib)
    cheap = Offer("adapter", "w1/a", int(0.9 * gib), 0.1)
    assert buy(need, [cheap]).bought == ()
    assert buy(replace(need, min_bytes=0), [cheap]).bought == (cheap,)  # growth: every byte helps
    rest = Offer("prefix", "w1/i1", gib, 0.2, divisible=True)  # a cache: cut to the 0.1 GiB still missing
    p = buy(need, [cheap, rest])
    assert p.covered and [o.source for o in p.bought] == ["adapter", "prefix"]
    assert p.bought[1].bytes == gib - int(0.9 * gib)
    with pytest.raises(ValueError, match="min_bytes"):
        Need("worker:w1", 10, 10.0, 1, 0.0, min_bytes=11)


def test_buy_prices_an_offer_by_the_bytes_it_is_used_for() -> None:
    need = Need("worker:w1", 100, 10.0, 1, 0.0)  # 0.1 a byte to wait
    big = Offer("layers", "w1+w2", 1000, 1.0)  # cheapest per byte, but 1.0 for the 100 B used: 0.01
    small = Offer("migrate", "r1", 100, 0.5)  # 0.005 per useful byte
    assert buy(need, [big, small]).bought == (small,)


def test_buy_leaves_the_need_waiting_when_nothing_is_cheaper() -> None:
    need = Need("worker:w1", 1000, 10.0, 1, 100.0)  # 10 s to drain, capped at 10: 10 request-s
    p = buy(need, [Offer("scale_out", "w3/m", 1000, 11.0), Offer("migrate", "r1", 500, 5.0)])  # 5/500 = 0.01 = waiting
    assert p.bought == () and not p.covered and p.price == pytest.approx(queue_price(need))


def test_buy_breaks_ties_by_source_then_target_and_skips_offers_that_free_nothing() -> None:
    need = Need("worker:w1", 100, 10.0, 1, 0.0)
    a = Offer("adapter", "w1/a", 100, 1.0)
    b = Offer("prewarm", "w1/z", 100, 1.0)
    c = Offer("prewarm", "w1/b", 100, 1.0)
    nothing = Offer("migrate", "r0", 0, 0.0)
    p = buy(need, [a, b, c, nothing])
    assert p.bought == (c,) and nothing not in p.offers
    with pytest.raises(ValueError, match="price finite"):
        Offer("prewarm", "w1/p", 10, math.inf)


def test_one_eviction_price_for_a_replica_and_for_a_live_instance() -> None:
    # a replica: the next start is a 12 s cold start instead of a 2 s hit; chance 0.5, 1 req/s arriving:
    # 0.5 x 10 x (1 + 1 x 10 / 2) = 30 request-s
    assert price_eviction(0.5, 1.0, 12.0, 2.0) == pytest.approx(30.0) == price_prewarm_eviction(0.5, 1.0, 12.0, 2.0)
    # a live instance scaled down: no start at all was what it would have given: 0.5 x 12 x (1 + 6) = 42
    assert price_capacity_eviction(0.5, 1.0, 12.0, 0.0, 30.0) == pytest.approx(42.0) == price_eviction(0.5, 1.0, 12.0, 0.0)
    assert price_capacity_eviction(0.0, 9.0, 12.0, 300.0, 30.0) == 0.0  # never needed before it is back: free
    # taken for a need lasting 18 s, it is back 18 s + its 12 s cold start later: 0.5 x 30 x (1 + 15) = 240
    assert price_capacity_eviction(0.5, 1.0, 12.0, 18.0, 30.0) == pytest.approx(240.0) == price_eviction(0.5, 1.0, 30.0, 0.0)
    # taken for 300 s: its arrivals wait at most the horizon (10 s) before they buy an instance back, then its start
    assert price_capacity_eviction(0.5, 1.0, 12.0, 300.0, 10.0) == pytest.approx(price_eviction(0.5, 1.0, 22.0, 0.0))
    assert price_capacity_eviction(0.5, 1.0, 12.0, 300.0, 10.0) < price_capacity_eviction(0.5, 1.0, 12.0, 300.0, 300.0)
    with pytest.raises(ValueError, match="gone_s"):
        price_capacity_eviction(0.5, 1.0, 12.0, -1.0, 10.0)
    with pytest.raises(ValueError, match="horizon_s"):
        price_capacity_eviction(0.5, 1.0, 12.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        price_eviction(0.5, -1.0, 12.0, 2.0)


def test_a_drop_lasts_until_its_excess_kv_drains_at_the_net_drain_within_the_horizon_and_the_window() -> None:
    assert drop_duration_s(40e9, 1e9, 10.0, 300.0) == pytest.approx(40.0)  # 40 GB above the restore level, 1 GB/s net
    assert drop_duration_s(4e9, 1e9, 10.0, 300.0) == 10.0  # drains within the horizon: the need's own duration
    assert drop_duration_s(0, 0.0, 10.0, 300.0) == 10.0  # already below the restore level
    assert drop_duration_s(1e9, 0.0, 10.0, 300.0) == 300.0  # its KV does not fall: until the load may change
    assert drop_duration_s(1e9, -5e8, 10.0, 300.0) == 300.0  # it grows faster than it frees: the same
    assert drop_duration_s(1e12, 1e9, 10.0, 300.0) == 300.0
    # priced over that duration: 0.208 slowdown x 20 running x (40 s + 2 s restore)
    assert price_layer_drop(0.208, 20, drop_duration_s(40e9, 1e9, 10.0, 300.0), 2.0) == pytest.approx(0.208 * 20 * 42)
    with pytest.raises(ValueError):
        drop_duration_s(-1, 1.0, 10.0, 300.0)
    with pytest.raises(ValueError):
        drop_duration_s(1, 1.0, 10.0, 5.0)


def test_a_need_lasts_until_its_drain_net_of_the_arrivals_inflow_frees_it() -> None:
    # issue 32: arrivals keep a need alive; without them it is the drain alone (drop_duration_s at the gross drain)
    assert need_duration_s(40e9, 1e9, 0.0, 10.0, 300.0) == drop_duration_s(40e9, 1e9, 10.0, 300.0) == 40.0
    assert need_duration_s(40e9, 1e9, 0.5e9, 10.0, 300.0) == pytest.approx(80.0)  # 0.5 GB/s net
    assert need_duration_s(40e9, 1e9, 1e9, 10.0, 300.0) == 300.0  # arrivals bring what the drain frees
    assert need_duration_s(40e9, 1e9, 2e9, 10.0, 300.0) == 300.0  # more: it persists until the load may change
    assert need_duration_s(4e9, 1e9, 0.5e9, 10.0, 300.0) == 10.0  # drains within the horizon even so
    for bad in ((1e9, -1.0, 0.0), (1e9, 1.0, -1.0), (1e9, 1.0, math.inf)):
        with pytest.raises(ValueError):
            need_duration_s(*bad, 10.0, 300.0)

"""Cached prefix blocks as an arbiter source, through the planner core (pure): the worker's stats carry
each instance's cached-free blocks and hit rate into the view, the arbiter prices them
(shared/planner/arbiter_prefix.py), buys the cold cache before the hot one, and the bought effect
becomes the worker command `EvictPrefixBlocks` (shared/planner/effects.py)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

from shared.events import InstanceStats, LayerRange, PoolBreakdown, WorkerState, WorkerStats
from shared.events.ctl import EvictPrefixBlocks
from shared.events.plan import ReleasePrefixBlocks
from shared.planner import PlannerCore
from shared.planner.arbiter_offers import find_needs
from shared.planner.effects import action_of, ctl_commands
from shared.planner.view import ClusterView, worker_view

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arbiter_views import KIB, LIKELY, MIB, SETTINGS, arbiter, cluster, needy_w1  # noqa: E402

CACHED_BLOCK = 512 * KIB  # one 16-token block over the 8 layers (32 KiB per token)


def two_caches(*, waiting: int, cold_blocks: int = 80, hot_blocks: int = 160) -> ClusterView:
    """w1 runs m twice: 350 MiB of live KV of 500, and cached-free prefixes: w1-m's cold (hit rate 0.1, 40 MiB
    by default), w1-m2's hot (0.9, 80 MiB). The need counts the cached bytes as held: 51.25 MiB short."""
    w1 = needy_w1(waiting=waiting, used=700)
    (inst,) = w1.instances
    cold = replace(inst, prefix_cached_free_blocks=cold_blocks, prefix_cached_free_bytes=cold_blocks * CACHED_BLOCK,
                   prefix_hit_rate=0.1)
    hot = replace(inst, instance_id="w1-m2", running=0, waiting=0, queued_prompt_tokens=0, kv_blocks_used=0,
                  requests=(), prefix_cached_free_blocks=hot_blocks,
                  prefix_cached_free_bytes=hot_blocks * CACHED_BLOCK, prefix_hit_rate=0.9)
    return cluster(p_forecast=LIKELY, w1=replace(w1, instances=(cold, hot)))


def test_the_cold_cache_is_released_and_the_hot_one_kept_when_waiting_is_cheaper() -> None:
    view = two_caches(waiting=1)
    (need,) = find_needs(view, SETTINGS)
    # 1000 prompt tokens x 32 KiB + 20 MiB above the 450 MiB watermark (350 MiB live + 120 MiB cached)
    assert need.bytes == 53_739_520
    arb = arbiter()
    core = PlannerCore([arb], id_prefix="c")
    effects = core.step(view)
    (effect,) = effects
    assert action_of(effect) == ReleasePrefixBlocks(worker_id="w1", instance_id="w1-m", blocks=80)
    (purchase,) = arb.take_purchases(effects)
    prices = {(p.source, p.target): p for p in purchase.prices}
    cold, hot = prices[("prefix", "w1/w1-m")], prices[("prefix", "w1/w1-m2")]
    # 80 blocks = 40 MiB = 1280 tokens, reused with chance 0.1, 0.5 ms of prefill each
    assert cold.bought and cold.bytes == 40 * MIB and cold.price_request_s == pytest.approx(0.1 * 1280 * 5e-4)
    assert cold.plan_ids == [effect.plan_id]
    # the hot cache would cover the rest (11.25 MiB) at 0.9 x 360 tokens x 0.5 ms = 0.162 request-s; waiting
    # for those bytes costs 1 request x 0.293 s (51.25 MiB at 175 MiB/s) x 11.25 / 51.25 = 0.064: it is kept
    assert not hot.bought and not prices[("prewarm", "w1/p")].bought
    assert purchase.bought_bytes == 40 * MIB and not purchase.reason.startswith("nothing")
    (cmd,) = ctl_commands(effect)
    assert cmd == ("w1", EvictPrefixBlocks(idempotency_key=f"{effect.plan_id}:0", plan_id=effect.plan_id,
                                           instance_id="w1-m", blocks=80))


def test_with_dearer_waiting_the_hot_cache_goes_too_after_the_cold_one_cut_to_what_is_missing() -> None:
    view = two_caches(waiting=16)
    arb = arbiter()
    decisions = arb.decide(view, core_busy())
    (purchase,) = arb.take_purchases([])
    bought = [(p.target, p.bytes) for p in purchase.prices if p.bought]
    assert [t for t, _ in bought] == ["w1/w1-m", "w1/w1-m2"]  # cheapest per byte first
    assert dict(bought)["w1/w1-m2"] == 53_739_520 - 40 * MIB  # only what the cold one left missing
    blocks = {d.action.instance_id: d.action.blocks for d in decisions}  # type: ignore[union-attr]
    assert blocks == {"w1-m": 80, "w1-m2": 23}  # 11.25 MiB in 512 KiB blocks, rounded up
    assert purchase.bought_bytes == purchase.need_bytes  # covered, nothing past it


def test_a_cache_that_is_never_hit_is_free_and_bought_before_a_cheap_adapter() -> None:
    from shared.planner.view import AdapterView

    view = two_caches(waiting=1, cold_blocks=150, hot_blocks=20)  # 16.25 MiB short: the cold cache covers it
    w1 = view.workers["w1"]
    cold = replace(w1.instances[0], prefix_hit_rate=0.0)
    w1 = replace(w1, instances=(cold, w1.instances[1]), adapters=(AdapterView("a", 64 * MIB),))
    view = cluster(p_forecast=LIKELY, w1=w1, adapter_rps={"a": 0.0})  # an adapter nobody uses: also free
    arb = arbiter()
    decisions = arb.decide(view, core_busy())
    (purchase,) = arb.take_purchases([])
    assert [(p.source, p.bought) for p in purchase.prices][:2] == [("prefix", True), ("adapter", False)]
    assert [type(d.action).__name__ for d in decisions] == ["ReleasePrefixBlocks"]
    assert purchase.prices[0].price_request_s == 0.0


def test_old_stats_without_prefix_fields_decode_and_new_ones_reach_the_view() -> None:
    inst = InstanceStats(instance_id="i1", model="m", layers=LayerRange(start=0, end=8))
    stripped = {k: v for k, v in msgspec.json.decode(msgspec.json.encode(inst)).items() if not k.startswith("prefix_")}
    assert "accepting" in stripped and not any(k.startswith("prefix") for k in stripped)  # as an older worker sends
    assert msgspec.json.decode(msgspec.json.encode(stripped), type=InstanceStats).prefix_hit_rate == 0.0
    new = msgspec.structs.replace(inst, prefix_cached_free_blocks=7, prefix_cached_free_bytes=7 * CACHED_BLOCK,
                                  prefix_hit_rate=0.25, prefix_queried_blocks=40, prefix_hit_blocks=10)
    stats = WorkerStats(worker_id="w1", seq=0, ts=1.0, device="cpu", state=WorkerState.READY,
                        pool=PoolBreakdown(capacity_bytes=1), instances=[new])
    back = msgspec.json.decode(msgspec.json.encode(stats), type=WorkerStats)
    (view_inst,) = worker_view(back).instances
    assert (view_inst.prefix_cached_free_blocks, view_inst.prefix_cached_free_bytes, view_inst.prefix_hit_rate) == \
        (7, 7 * CACHED_BLOCK, 0.25)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(msgspec.structs.replace(new, prefix_hit_rate=1.5)), type=InstanceStats)


def core_busy():  # type: ignore[no-untyped-def]
    from shared.planner.policy import Busy

    return Busy(())

"""The memory arbiter (shared/planner/arbiter.py) on hand-built views (tests/arbiter_views.py): worked
examples of what it buys, what it passes through, how plan ids reach a purchase, and what a failure does."""
from __future__ import annotations

import pytest

from shared.events.plan import (
    PlanApplied, PlanFailed, ReleaseAdapter, ReleasePrewarm, ReportIdle, RestoreInstanceLayers, ScaleDown,
)
from shared.events.common import LayerRange
from shared.planner import PlannerCore
from shared.planner.arbiter_offers import find_needs, prewarm_price
from shared.planner.effects import Decision, action_of
from shared.planner.view import AdapterView
from shared.policy.memory_market import queue_price

from arbiter_views import (
    GIB, LIKELY, MIB, SETTINGS, UNLIKELY, Stub, arbiter, cluster, group_w1_w2, move_r1, needy_w1, pricing,
    request,
)


def kinds(decisions: list[Decision]) -> list[str]:
    return [type(d.action).__name__ for d in decisions]


def test_the_needy_worker_is_found_with_its_prompts_growth_and_watermark() -> None:
    view = cluster(p_forecast=UNLIKELY)
    (need,) = find_needs(view, SETTINGS)
    used, capacity = 950 * 8 * 64 * 1024, 1000 * 8 * 64 * 1024
    prompts = 1000 * 32 * 1024  # 1000 queued prompt tokens x 32 KiB
    assert need.scope == "worker:w1" and need.waiting == 16
    assert need.bytes == int(prompts - (0.9 * capacity - used))
    assert need.drain_bytes_per_s == pytest.approx(used / 2.0)  # Little's law: all of it turns over in 2 s


def test_an_unlikely_prewarm_is_released_before_a_layer_drop() -> None:
    kun = Stub("kunserve", [group_w1_w2()])
    arb = arbiter(kun)
    view = cluster(p_forecast=UNLIKELY)
    decisions = arb.decide(view, _no_busy())
    assert kinds(decisions) == ["ReleasePrewarm"]
    assert decisions[0].action == ReleasePrewarm(worker_id="w1", model="p")
    assert kun.declined == [kun.decisions[0]]  # told: the group was not bought
    (purchase,) = arb.take_purchases([])
    assert purchase.scope == "worker:w1" and purchase.bought_bytes == 2 * GIB
    assert [(p.source, p.bought) for p in purchase.prices] == [("prewarm", True), ("layers", False)]
    # the drop was cheaper than waiting too, just dearer than the replica nobody will need
    layers = purchase.prices[1]
    assert layers.price_request_s / min(layers.bytes, purchase.need_bytes) < purchase.reserve_request_s_per_byte


def test_a_likely_prewarm_is_kept_and_a_cheaper_migration_bought() -> None:
    mell = Stub("mell", [move_r1()])
    arb = arbiter(mell)
    view = cluster(p_forecast=LIKELY)
    decisions = arb.decide(view, _no_busy())
    assert kinds(decisions) == ["Migrate"]
    (purchase,) = arb.take_purchases([])
    prices = {p.source: p for p in purchase.prices}
    assert prices["migrate"].bought and not prices["prewarm"].bought
    # the replica is dearer than waiting for the bytes it would give: a 2.4 s cold start, likely paid
    (need,) = find_needs(view, SETTINGS)
    assert prewarm_price(view, pricing(), view.workers["w1"], "p") > queue_price(need)


def test_nothing_cheaper_than_waiting_buys_nothing_and_the_purchase_says_so() -> None:
    arb = arbiter()
    decisions = arb.decide(cluster(p_forecast=LIKELY), _no_busy())
    assert decisions == []
    (purchase,) = arb.take_purchases([])
    assert purchase.bought_bytes == 0 and [p.bought for p in purchase.prices] == [False]
    assert "nothing cheaper than waiting" in purchase.reason
    assert purchase.price_request_s == pytest.approx(purchase.need_bytes * purchase.reserve_request_s_per_byte)


def test_plan_ids_reach_the_purchase_and_a_failed_target_is_not_bought_again_for_a_horizon() -> None:
    kun = Stub("kunserve", [group_w1_w2()])
    arb = arbiter(kun)
    core = PlannerCore([arb], id_prefix="c")
    effects = core.step(cluster(100.0, p_forecast=UNLIKELY))
    (purchase,) = arb.take_purchases(effects)
    (effect,) = effects
    assert isinstance(action_of(effect), ReleasePrewarm)
    assert [p.plan_ids for p in purchase.prices if p.bought] == [[effect.plan_id]]
    core.dispatched(effect.plan_id)
    core.on_outcome(PlanFailed(plan_id=effect.plan_id, ts=100.5, action_index=0, message="EvictModel refused"))

    kun.declined.clear()
    again = core.step(cluster(101.0, p_forecast=UNLIKELY))  # same need: the layer drop now, not the replica
    assert kinds([Decision(action=action_of(e), trigger="manual") for e in again]) == ["FormGroup"]
    (purchase,) = arb.take_purchases(again)
    assert [p.source for p in purchase.prices] == ["layers"]  # the failed offer is not even on the list
    assert kun.declined == []
    core.on_outcome(PlanApplied(plan_id=again[0].plan_id, ts=101.2, duration_s=0.1))
    assert kun.outcomes == [("FormGroup", "PlanApplied")]  # forwarded to the policy that proposed it

    later = core.step(cluster(111.0, p_forecast=UNLIKELY))  # a horizon later the replica is offered again
    (purchase,) = arb.take_purchases(later)
    assert [(p.source, p.bought) for p in purchase.prices] == [("prewarm", True), ("layers", False)]


def test_offers_on_a_dead_worker_are_never_bought() -> None:
    kun = Stub("kunserve", [group_w1_w2()])
    arb = arbiter(kun)
    decisions = arb.decide(cluster(p_forecast=LIKELY, w2_alive=False), _no_busy())
    assert "FormGroup" not in kinds(decisions) and kun.declined == [kun.decisions[0]]


def test_decisions_that_buy_no_memory_pass_through_unchanged_and_follow_ups_are_forwarded() -> None:
    idle = Decision(action=ReportIdle(worker_id="w2", since_ts=1.0), trigger="idle")
    down = Decision(action=ScaleDown(instance_id="w2-p", worker_id="w2", model="p"), trigger="idle")
    restore = Decision(action=RestoreInstanceLayers(worker_id="w2", instance_id="w2-q", layers=LayerRange(start=0, end=2)),
                       trigger="kv_pressure")
    stub = Stub("mech", [idle, down], follow=[restore])
    arb = arbiter(stub)
    view = cluster(p_forecast=LIKELY)
    decisions = arb.decide(view, _no_busy())
    assert decisions[0] is idle and decisions[1] is down
    core = PlannerCore([arb], id_prefix="c")
    core.step(view)
    (follow,) = core.follow_up(view)
    assert action_of(follow) == restore.action
    core.on_outcome(PlanApplied(plan_id=follow.plan_id, ts=1.0, duration_s=0.0))
    assert ("RestoreInstanceLayers", "PlanApplied") in stub.outcomes


def test_a_cold_adapter_is_evicted_when_it_is_cheap() -> None:
    w1 = needy_w1(prewarmed={}, adapters=(AdapterView("cold", 64 * MIB), AdapterView("hot", 64 * MIB)))
    arb = arbiter()
    decisions = arb.decide(cluster(w1=w1, adapter_rps={"hot": 50.0}), _no_busy())
    # both cost a reload from the host copy; "cold" is never used within the horizon: free
    assert decisions[0].action == ReleaseAdapter(worker_id="w1", adapter="cold")
    (purchase,) = arb.take_purchases([])
    by_target = {p.target: p for p in purchase.prices}
    assert by_target["w1/cold"].price_request_s == 0.0 and by_target["w1/hot"].price_request_s > 0.0


def _no_busy():  # type: ignore[no-untyped-def]
    from shared.planner.policy import Busy
    return Busy(())


def test_growth_that_does_not_fit_prices_the_requests_it_would_preempt() -> None:
    import dataclasses
    from types import MappingProxyType

    base = needy_w1(waiting=0, prompt_tokens=0, requests=(request("r1", 40 * MIB), request("r2", 20 * MIB)),
                    running=2)
    inst = dataclasses.replace(base.instances[0], kv_growth_blocks_per_s=400.0)  # 400 blocks x 64 KiB a second
    w1 = dataclasses.replace(base, instances=(inst,), prewarmed=MappingProxyType({}))
    view = cluster(w1=w1)
    (plain,) = find_needs(view, SETTINGS)
    assert plain.preempted == 0 and plain.recompute_s == 0.0  # without a prefill cost: waiting only
    p = pricing()
    (need,) = find_needs(view, SETTINGS, p.prefill)
    room = 0.9 * w1.kv_capacity_bytes - w1.kv_used_bytes  # negative: already above the watermark
    growth = 400.0 * 64 * 1024 * SETTINGS.horizon_s
    assert need.preempted == min(2, -(-(growth - max(0.0, room)) // (30 * MIB)))  # mean request KV: 30 MiB
    assert need.recompute_s == pytest.approx(p.prefill.reprefill_s(round((1280 + 640) / 2)))
    assert queue_price(need) > queue_price(plain)  # preempting is dearer than waiting alone


def test_a_start_that_evicts_a_warm_replica_pays_that_evictions_full_price() -> None:
    # issue 32: a start of m on w1 takes the GPU where p's 2 GiB are prewarmed; it pays p's prewarm eviction
    # price (p's chance *and* its 2 req/s arriving during the extra cold start), not just chance x cold start
    from shared.events.plan import ScaleUp
    from shared.planner.arbiter_offers import load_s, scale_out
    view, p = cluster(p_forecast=LIKELY), pricing()
    nbytes, price, lands = scale_out(view, p, ScaleUp(model="m", worker_id="w1", instance_id="w1-m2"), waiting=3)
    eviction = prewarm_price(view, p, view.workers["w1"], "p")
    assert eviction > 0
    assert price == pytest.approx(3 * load_s(p, 512 * MIB) + eviction)
    assert lands == pytest.approx(load_s(p, 512 * MIB))  # its bytes exist once it lands


def test_a_layer_drop_is_priced_from_the_groups_slowdown_live_as_in_the_simulator() -> None:
    # issue 32: 1/eff - 1 per running request (w1-m's one; w2 has no m) over the horizon and the restore, not 1 - eff
    from shared.planner.arbiter_offers import group_freed, layer_price
    view, p = cluster(p_forecast=LIKELY), pricing()
    eff = p.pipeline.efficiency(2)
    restore = max(p.costs.layer_restore_s(b) for b in group_freed(view, group_w1_w2().action).values())
    assert layer_price(view, p, group_w1_w2().action) == pytest.approx((1 / eff - 1) * 1 * (10.0 + restore))


def test_a_model_with_nothing_running_needs_an_instances_weights_all_or_nothing() -> None:
    # issue 32: p's 2 GiB of weights are indivisible: half of them starts nothing
    from dataclasses import replace as dreplace
    from shared.planner.arbiter_offers import model_need
    view = dreplace(cluster(), workers={})
    need = model_need(view, "p", 3, set(), SETTINGS)
    assert need is not None and need.bytes == need.min_bytes == 2 * GIB

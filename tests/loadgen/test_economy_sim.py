"""The economy simulator (loadgen/sim/economy*.py): every arm serves every request once, the unbounded
arm is a lower bound, each source's action does and costs what the cost models say, the arbiter buys the
cheaper source, and every GPU's pool adds up to its usable memory."""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import numpy as np
import pytest

from loadgen.sim.economy import EconomySim, run_economy
from loadgen.sim.economy_profile import load_economy_profile, with_models
from loadgen.sim.economy_result import ARMS
from loadgen.sim.economy_state import scaled
from loadgen.sim.fleet_scaling import scale_up
from loadgen.sim.fleet_state import Replica
from loadgen.sim.request import SimRequest
from loadgen.traces.mixed import generate_mixed
from loadgen.traces.schema import MixedParams
from shared.policy.memory_market import Need, buy, price_layer_drop, price_migration
from shared.policy.warmserve_predictor import LoadForecast

GPUS = 8


@lru_cache(maxsize=1)
def profile():
    """The economy profile with vLLM's own batch cap (256), so a small fleet runs out of KV."""
    p = load_economy_profile("economy-h800")
    return dataclasses.replace(p, fleet=with_models(p.fleet, batch_size=256))


@lru_cache(maxsize=1)
def trace():
    p = profile()
    return generate_mixed(MixedParams(seed=3, duration_s=120.0, rate=25.0, period_s=120.0,
                                      models=[m.name for m in p.fleet.models], adapter_models=p.adapter_models,
                                      adapters_per_model=20, long_fraction=0.3))


@lru_cache(maxsize=None)
def result(arm: str):
    sim = EconomySim(profile(), trace(), arm, gpus=GPUS)
    return sim, sim.run()


@pytest.mark.parametrize("arm", ARMS)
def test_every_request_finishes_once(arm):
    sim, res = result(arm)
    n = len(trace().records)
    assert len(res.ttft) == n and sim.done == n
    assert not np.isnan(res.ttft).any() and res.counts["failed_requests"] == 0
    assert all(i.outstanding == 0 for insts in sim.instances.values() for i in insts)
    assert not sim.moving


def test_unbounded_is_a_lower_bound():
    bound = result("unbounded")[1].p99_ttft()
    for arm in ARMS:
        assert bound <= result(arm)[1].p99_ttft() + 1e-9, arm


@pytest.mark.parametrize("arm", ["kunserve", "warmserve", "fixed-order", "arbiter", "caraserve"])
def test_pool_samples_sum_to_usable_memory(arm):
    _, res = result(arm)
    usable = profile().fleet.gpu.usable_bytes
    block = max(m.kv_bytes_per_token * 16 for m in profile().fleet.models)
    assert res.pool
    for s in res.pool:
        total = s.weights + s.prewarm + s.adapter + s.kv_used + s.kv_free
        assert usable - block <= total <= usable, s


def _hand_sim(arm: str, forecasts=None) -> EconomySim:
    """Two llama2-7b-0 instances (GPUs 0 and 1) and nothing else running."""
    p = profile()
    tr = generate_mixed(MixedParams(seed=0, duration_s=1.0, rate=1.0, models=["llama2-7b-0"]))
    sim = EconomySim(p, tr, arm, gpus=16, forecasts=forecasts)  # 8 GPUs for the initial instances, 8 free
    sim.now = 0.0
    assert scale_up(sim, "llama2-7b-0", 0.0, initial=True) is not None
    assert len(sim.instances["llama2-7b-0"]) == 2
    return sim


def _decoding(sim: EconomySim, inst, k: int, prompt: int = 1000, output: int = 500) -> list[SimRequest]:
    """k requests prefilled on the instance at t = 0 and decoding."""
    reqs = [SimRequest(10_000 + inst.id * 100 + j, f"h{inst.id}-{j}", inst.model, None, 0.0, prompt, output)
            for j in range(k)]
    w = inst.engine
    for r in reqs:  # queued together, so one prefill step admits them all
        r.worker = w.worker_id
        w.waiting.append(r)
        w.queued_tokens += r.to_prefill
        inst.outstanding += 1
    w.complete(w.plan(0.0))
    assert w.decoding == k
    sim.served_by = [-1] * 20_000
    return reqs


def test_layer_drop_gives_both_buddies_the_weights_as_kv_and_slows_them():
    sim = _hand_sim("kunserve")
    a, b = sim.instances["llama2-7b-0"]
    m = sim.models["llama2-7b-0"]
    before = [i.engine.pool.kv_blocks() for i in (a, b)]
    base = [i.engine.cost for i in (a, b)]
    offer = next(o for o in sim.pricer.layer_offers(a, 0.0) if o.payload[2] is b)
    assert sim.executor.execute(offer, 0.0)
    dropped = sim.profile.weights_per_gpu(m) // 2
    block = m.kv_bytes_per_token * 16
    eff = profile().pipeline.efficiency(2)
    for inst, blocks, cost in zip((a, b), before, base):
        assert inst.engine.pool.dropped == dropped
        assert inst.engine.pool.kv_blocks() - blocks in (dropped // block, dropped // block + 1)
        assert inst.engine.cost.step_s(8, 8000, 100) == pytest.approx(cost.step_s(8, 8000, 100) / eff)
    assert sim.counts["groups"] == 1 and sim.group_of[a.id] is b and sim.group_of[b.id] is a
    # restore: both far below 50%: the weights go back over the host link, then the pipeline ends
    sim.executor.restore_groups(1.0)
    assert a.engine.pool.dropped == 0 and b.engine.pool.kv_blocks() == before[1]
    restore_s = sim.moves.layer_restore_s(dropped)
    (t, _, kind, ids, _) = min(e for e in sim.heap if e[2] == 7)
    assert t == pytest.approx(1.0 + restore_s)
    sim.executor.restored(ids, t)
    assert a.engine.cost == base[0] and not sim.group_of


def test_migration_pays_the_precopy_stall():
    sim = _hand_sim("mell")
    a, b = sim.instances["llama2-7b-0"]
    reqs = _decoding(sim, a, 3, prompt=1500, output=400)
    for r in reqs:
        sim.served_by[r.order] = a.id
    offers = sim.pricer.migrate_offers(a, 0.0)
    assert len(offers) == 1
    req, dst, plan = offers[0].payload[2]
    assert dst is b and plan.ok
    w = a.engine
    assert plan == sim.moves.kv_precopy(req.ctx0 + w.step - req.start_step, w.bs, w.pool.block_bytes, w.step_s())
    assert offers[0].price == price_migration(plan.stall_s) == plan.stall_s
    assert sim.executor.execute(offers[0], 0.0)
    assert b.engine.used == plan.blocks and b.outstanding == 1
    sim.executor.move_event("handover", a, plan.precopy_s)
    assert sim.executor.migration_stall_s == plan.stall_s
    sim.executor.move_event("landed", a, plan.precopy_s + plan.stall_s)
    assert sim.counts["migrations"] == 1 and req.worker == b.engine.worker_id and sim.served_by[req.order] == b.id
    assert sim.purchases[-1].price_request_s == plan.stall_s


def test_a_model_without_a_forecast_is_priced_needed_as_live():
    # issue 32: no forecast meant chance 0 here and 1 live; one default now (memory_market.NO_FORECAST_CHANCE)
    from shared.policy.memory_market import NO_FORECAST_CHANCE
    sim = _hand_sim("arbiter")
    assert NO_FORECAST_CHANCE == 1.0 and sim.pricer.chance_needed("llama2-13b") == NO_FORECAST_CHANCE


def test_arbiter_releases_an_unwanted_prewarm_before_dropping_layers():
    zero = {m.name: [LoadForecast(0.0, 0.0)] for m in profile().fleet.models}
    sim = _hand_sim("arbiter", forecasts=zero)
    a, b = sim.instances["llama2-7b-0"]
    _decoding(sim, a, 20)
    _decoding(sim, b, 20)
    # a llama2-13b replica lent into a's KV, whose model the forecast says nobody needs
    r = Replica("llama2-13b", a.gpus, 4 * 2**30, 0.0, origin="proactive", proactive=True)
    sim.add_replica(r)
    a.kv_lent_blocks = math.ceil(r.bytes_per_gpu / a.engine.pool.block_bytes)
    a.engine.pool.lent_blocks = a.kv_lent_blocks
    need = Need(f"worker:i{a.id}", 2 * 2**30, 10.0, 5, 0.0)
    purchase = buy(need, sim.arbiter.offers(a, 0.0, need))
    assert [o.source for o in purchase.bought] == ["prewarm"]
    layers = next(o for o in purchase.offers if o.source == "layers")
    assert layers.price > 0 and layers.price == pytest.approx(price_layer_drop(
        1 / profile().pipeline.efficiency(2) - 1, 40, 10.0, sim.moves.layer_restore_s(a.engine.pool.weights // 2)))
    assert sim.executor.execute(purchase.bought[0], 0.0)
    assert r not in sim.replicas and a.engine.pool.lent_blocks == 0


def test_the_same_action_costs_the_same_in_fixed_order_and_arbiter():
    prices = {}
    for arm in ("fixed-order", "arbiter"):
        sim = _hand_sim(arm)
        a, b = sim.instances["llama2-7b-0"]
        _decoding(sim, a, 12, prompt=1800)
        _decoding(sim, b, 4)
        layer = sim.pricer.layer_offers(a, 0.0)[0]
        move = sim.pricer.migrate_offers(a, 0.0)[0]
        assert sim.executor.execute(layer, 0.0)
        prices[arm] = [(p.source, p.bytes, p.price_request_s) for p in sim.purchases] + \
            [(move.source, move.bytes, move.price)]
    assert prices["fixed-order"] == prices["arbiter"]


def test_scaled_cost_is_step_time_over_efficiency():
    cost = profile().fleet.step_cost(profile().fleet.models[0])
    assert scaled(cost, 2.0).step_s(3, 100, 10) == pytest.approx(2 * cost.step_s(3, 100, 10))


def test_run_economy_smoke():
    res = run_economy(trace(), profile(), "arbiter", gpus=GPUS)
    assert res.arm == "arbiter" and res.gpus == GPUS and len(res.unloaded_ttft) == len(res.ttft)


def test_a_waiting_prompt_that_fits_only_whole_makes_the_need_all_or_nothing():
    # issue 32: no running request grows, the KV is nearly full and one long prompt waits: a purchase
    # helps only if that prompt fits whole (min_bytes = its bytes - the free KV)
    sim = _hand_sim("arbiter")
    a, _ = sim.instances["llama2-7b-0"]
    w, m = a.engine, sim.models["llama2-7b-0"]
    w.used = w.total - 2  # two blocks free
    r = SimRequest(19_999, "long", a.model, None, 0.0, 40 * w.bs, 10)
    r.worker = w.worker_id
    w.waiting.append(r)
    w.queued_tokens += r.to_prefill
    w.blocked_on = "memory"
    need = sim.arbiter.need(a, 0.0)
    free = 2 * w.pool.block_bytes
    assert need is not None and need.min_bytes == need.bytes == 40 * w.bs * m.kv_bytes_per_token - free

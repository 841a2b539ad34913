"""Capacity on the market (loadgen/sim/economy_capacity.py, issue 32 item 1): with no free GPU group, a
memory-blocked model's start is offered on an under-loaded model's GPUs, priced by that model's one eviction
price (forecast, arrivals) plus the drain and the start; bought, the victim drains and the start follows."""
from __future__ import annotations

from dataclasses import replace

import pytest

from loadgen.sim.economy import EconomySim
from loadgen.sim.economy_capacity import drain_s
from loadgen.sim.fleet_scaling import scale_up
from loadgen.sim.request import SimRequest
from loadgen.traces.mixed import generate_mixed
from loadgen.traces.schema import MixedParams
from shared.policy.memory_market import buy, price_capacity_eviction, price_scale_out
from shared.policy.warmserve_predictor import LoadForecast
from tests.loadgen.test_economy_sim import _decoding, profile

A, B = "llama2-7b-0", "llama2-7b-1"


def _bare_sim(p, tr, fc) -> EconomySim:  # type: ignore[no-untyped-def]
    """An arbiter simulation of 4 GPUs at t = 0 with nothing on them (no instance, no prewarmed replica)."""
    sim = EconomySim(p, tr, "arbiter", gpus=4, forecasts=fc)
    sim.now = 0.0
    for inst in [i for insts in sim.instances.values() for i in insts]:
        sim._release(inst, 0.0)
    for r in list(sim.replicas):
        sim.evict(r)
    return sim


def _full_sim(forecast_b: float = 0.0) -> EconomySim:
    """4 GPUs: one instance of A, three of B (B idle); A has requests waiting for memory."""
    p = profile()
    tr = generate_mixed(MixedParams(seed=0, duration_s=1.0, rate=1.0, models=[A, B]))
    fc = {m.name: [LoadForecast(forecast_b if m.name == B else 0.0, forecast_b if m.name == B else 0.0)]
          for m in p.fleet.models}
    sim = _bare_sim(p, tr, fc)
    assert scale_up(sim, A, 0.0, initial=True) is not None
    for _ in range(3):
        assert scale_up(sim, B, 0.0, initial=True) is not None
    assert all(g.instance is not None for g in sim.gpus)
    a = sim.instances[A][0]
    w = a.engine
    for j in range(3):
        r = SimRequest(j, f"wait-{j}", A, None, 0.0, 500, 50)
        r.worker = w.worker_id
        w.waiting.append(r)
        w.queued_tokens += r.to_prefill
        a.outstanding += 1
    w.blocked_on = "memory"
    w.used = w.total - 2  # its KV full (two blocks free): the prompts do not fit
    sim.served_by = [-1] * 100
    return sim


def test_a_start_on_an_idle_models_gpu_is_offered_at_the_one_eviction_price():
    sim = _full_sim()
    a = sim.instances[A][0]
    offers = sim.executor.reclaim.offers(a, 0.0, 100.0)
    assert len(offers) == 3 and {o.source for o in offers} == {"scale_out"}  # each idle B instance
    victim = offers[0].payload[2]
    assert victim.model == B and drain_s(victim) == 0.0
    m, vm = sim.models[A], sim.models[B]
    # B's forecast is 0: one instance fewer is still enough (chance 0), so only the wait for A's start is paid
    start = sim.profile.cold_start_s(m, sim.system.engine_pool)
    # each waiting request counts the wait past its TTFT SLO (max(5 x its unloaded TTFT, 1 s); all arrived at 0)
    slo = max(5.0 * sim.profile.step_cost(m).step_s(0, 0, 500), 1.0)
    assert 0 < start - slo < start
    assert offers[0].price == pytest.approx(price_scale_out(start, 3, 0.0, (slo,) * 3)) == \
        pytest.approx(3 * (start - slo))
    # its bytes exist once it lands (the victim holds nothing: no drain first)
    assert offers[0].after_s == pytest.approx(start)
    assert price_capacity_eviction(0.0, 5.0, sim.profile.cold_start_s(vm), 100.0, sim.horizon_s) == 0.0


def test_a_model_forecast_to_need_its_instances_is_dear_to_take():
    cheap = _full_sim(forecast_b=0.0)
    dear = _full_sim(forecast_b=10_000.0)  # B's forecast load needs every instance it has
    dear.arrivals[B].extend([0.5, 1.0])  # B's recent arrivals: 2 in the horizon
    price = [min(o.price for o in s.executor.reclaim.offers(s.instances[A][0], 1.0, 100.0)) for s in (cheap, dear)]
    vm = dear.models[B]
    # the arrivals the victim would have served (B's over its 3 live instances), for the need's 100 s and a restart
    evict = price_capacity_eviction(1.0, dear.pricer.rate(B, 1.0) / 3, dear.profile.cold_start_s(vm), 100.0,
                                    dear.horizon_s)
    assert evict > 0 and price[1] == pytest.approx(price[0] + evict)


def test_bought_the_victim_drains_and_the_blocked_model_starts_there():
    sim = _full_sim()
    a = sim.instances[A][0]
    need = sim.arbiter.need(a, 0.0) or pytest.fail("no need")
    purchase = buy(need, sim.arbiter.offers(a, 0.0, need))
    assert purchase.bought and purchase.bought[0].payload[0] == "reclaim"
    victim = purchase.bought[0].payload[2]
    assert sim.executor.execute(purchase.bought[0], 0.0)
    assert victim not in sim.instances[B]  # idle: released at once, and A started on its GPU
    assert len(sim.instances[A]) == 2 and sim.counts["capacity_starts"] == 1
    assert len(sim.instances[B]) == 2 and sim.counts["scale_out_moved"] >= 1


def test_a_model_with_one_live_instance_is_never_taken():
    sim = _full_sim()
    for inst in sim.instances[B][1:]:
        sim._release(inst, 0.0)
    for r in list(sim.replicas):
        sim.evict(r)
    # two GPUs free now: a plain start needs no victim, and B's last instance is never offered
    assert sim.executor.reclaim.offers(sim.instances[A][0], 0.0, 100.0) == []


def test_the_need_carries_its_waiting_requests_slack_and_lasts_until_its_drain_frees_it():
    # issue 32 item 2: the wait counts past each request's TTFT SLO, and the need lasts until it drains
    sim = _full_sim()
    a = sim.instances[A][0]
    need = sim.arbiter.need(a, 3.0)
    m = sim.models[A]
    slo = max(5.0 * sim.profile.step_cost(m).step_s(0, 0, 500), 1.0)
    assert need.slack_s == pytest.approx((slo - 3.0,) * 3)  # each arrived at 0, seen at 3 s
    assert sim.horizon_s <= need.duration_s <= max(sim.horizon_s, sim.window_s)
    if need.drain_bytes_per_s == 0:
        assert need.duration_s == max(sim.horizon_s, sim.window_s)  # nothing drains: the whole window
    # a start's bytes exist once it lands, and the waiting requests' wait past their SLO is its price
    start = next(o for o in sim.executor.reclaim.offers(a, 3.0, need.lasts_s))
    assert start.after_s > 0 and start.cover(need.lasts_s) < 1.0


def test_requests_queued_with_no_instance_of_their_model_buy_capacity_from_an_idle_model():
    # the live arbiter's `model:<name>` need, in the simulator: a model left with no instance (the autoscaler scaled
    # it to zero in a lull) and no free GPU used to queue at the fleet until a GPU freed by itself (at 25 req/s seed
    # 1, 399 13B requests queued for the popularity shift's last minute, P99 96 s)
    p = profile()
    tr = generate_mixed(MixedParams(seed=0, duration_s=1.0, rate=1.0, models=[A, B]))
    fc = {m.name: [LoadForecast(0.0, 0.0)] for m in p.fleet.models}
    sim = _bare_sim(p, tr, fc)
    for _ in range(4):
        assert scale_up(sim, B, 0.0, initial=True) is not None  # B idle on every GPU, A has none
    sim.served_by = [-1] * 100
    for j in range(3):
        sim.queues[A].append(SimRequest(j, f"q-{j}", A, None, 0.0, 500, 50))
    need = sim.arbiter.model_need(A, 0.0)
    assert need is not None and need.scope == f"model:{A}" and need.waiting == 3
    assert need.min_bytes == 500 * sim.models[A].kv_bytes_per_token  # the first prompt, whole
    assert len(sim.executor.reclaim.model_offers(A, 0.0, 100.0)) == 4  # each idle B instance
    sim.arbiter.tick(0.0)
    assert len(sim.instances[A]) == 1 and not sim.queues[A]  # started on a B instance's GPU, the queue sent there
    assert len(sim.instances[B]) == 3 and sim.counts["capacity_starts"] == 1
    assert sim.instances[A][0].id in sim.bought_starts  # the arbiter's own start, not the autoscaler's
    assert any(r.scope == f"model:{A}" and r.source == "scale_out" for r in sim.purchases)


def _decoded(sim: EconomySim, inst, done: int) -> tuple[SimRequest, float]:
    """One request decoding on the instance, run (by its engine) until it has decoded `done` tokens of its 500;
    the clock then."""
    (r,) = _decoding(sim, inst, 1, output=500)
    w, t = inst.engine, 0.0
    while w.step - r.start_step < done:
        t = w.plan(t)
        w.complete(t)
    assert r.finish < 0
    return r, t


def test_a_victims_drain_reads_the_tokens_its_running_requests_have_left():
    # a running request's `generated` is set when its decode run begins: read alone, a request 300 tokens into its
    # 500 counted 499 to go, and a victim's drain (so when a capacity offer lands) was read ~2.5x too long
    sim = _full_sim()
    v = sim.instances[B][0]
    r, _ = _decoded(sim, v, 300)
    left = r.output - r.gen_at_start - (v.engine.step - r.start_step)
    assert 0 < left <= 200 and r.output - r.generated >= 499
    assert drain_s(v) == pytest.approx(left * v.engine.step_s())


def test_a_capacity_offer_covers_only_the_needs_time_after_the_victim_drains_and_the_start_lands():
    # pricing and choosing stay apart: the offer says when its bytes exist (the victim's drain, then the start);
    # `buy` counts them only for the need's duration after that — a need over before then buys nothing
    sim = _full_sim()
    t, drains = 0.0, []
    for v in sim.instances[B]:
        r, at = _decoded(sim, v, 300)
        t = max(t, at)
        drains.append((r.output - r.gen_at_start - (v.engine.step - r.start_step)) * v.engine.step_s())
    a = sim.instances[A][0]
    need = sim.arbiter.need(a, t) or pytest.fail("no need")
    offers = sim.executor.reclaim.offers(a, t, need.lasts_s)
    start = sim.profile.cold_start_s(sim.models[A], sim.system.engine_pool)
    lands = min(drains) + start  # the victim's tokens left at its step time, then the start
    assert min(o.after_s for o in offers) == pytest.approx(lands)
    step = max(v.engine.step_s() for v in sim.instances[B])

    def reclaimed(duration_s: float) -> bool:
        n = replace(need, duration_s=duration_s)
        return any(o.payload[0] == "reclaim" for o in buy(n, sim.arbiter.offers(a, t, n)).bought)

    assert not reclaimed(0.9 * lands)  # over before the victim has drained and the start landed
    # lasting past the landing by less than the ~300 decoded tokens a drain read from `generated` added
    assert reclaimed(lands + 100 * step)


def test_a_capacity_offer_charges_the_victims_arrivals_for_as_long_as_the_need_holds_it():
    # the victim takes no request from the moment it is taken until a restart after the need: a model forecast to
    # need it pays for its arrivals over that span (before: over the restart alone, a 9 s need and a 2 s one
    # alike), up to the horizon, after which they would buy an instance back (a 300 s need costs as a 10 s one)
    sim = _full_sim(forecast_b=10_000.0)
    sim.arrivals[B].extend([0.5, 1.0])
    a = sim.instances[A][0]
    assert sim.horizon_s == 10.0
    short, long, longest = (min(o.price for o in sim.executor.reclaim.offers(a, 1.0, d)) for d in (2.0, 9.0, 300.0))
    rate, cold = sim.pricer.rate(B, 1.0) / 3, sim.profile.cold_start_s(sim.models[B], sim.system.engine_pool)
    assert long - short == pytest.approx(price_capacity_eviction(1.0, rate, cold, 9.0, 10.0)
                                         - price_capacity_eviction(1.0, rate, cold, 2.0, 10.0))
    assert long - short > 0
    assert longest - long == pytest.approx(price_capacity_eviction(1.0, rate, cold, 10.0, 10.0)
                                           - price_capacity_eviction(1.0, rate, cold, 9.0, 10.0))


def test_a_victims_arrivals_are_read_over_as_long_a_past_as_the_span_they_are_charged_for():
    # B got a request a second for 90 s and none in the last 10 s horizon: a capacity taken for a 100 s need is
    # charged 0.9 req/s (over B's 3 instances), not the horizon's 0 (the 13B at the popularity shift's start,
    # 25 req/s seed 3: its rate read 5.7 -> 0.0 in 6 s and its instance was taken then, to be missed later)
    quiet, steady = _full_sim(forecast_b=10_000.0), _full_sim(forecast_b=10_000.0)
    steady.arrived[B].extend(float(t) for t in range(90))
    assert steady.pricer.rate(B, 100.0) == 0.0 and steady.pricer.rate_over(B, 100.0, 100.0) == pytest.approx(0.9)
    a = [s.instances[A][0] for s in (quiet, steady)]
    price = [min(o.price for o in s.executor.reclaim.offers(i, 100.0, 100.0)) for s, i in zip((quiet, steady), a)]
    cold = steady.profile.cold_start_s(steady.models[B], steady.system.engine_pool)
    assert price[1] - price[0] == pytest.approx(price_capacity_eviction(1.0, 0.9 / 3, cold, 100.0, steady.horizon_s)
                                                - price_capacity_eviction(1.0, 0.0, cold, 100.0, steady.horizon_s))
    assert price[1] > price[0]

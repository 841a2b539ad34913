"""Capacity on the market, live (shared/planner/arbiter_capacity.py, issue 32 item 1): for a model whose
requests are queued with nowhere to go, the arbiter offers to scale down an instance of an under-loaded
model, priced by the one eviction price (that model's chance of needing it, one instance fewer, and its
arrivals) plus the wait until the victim drains and the start lands; a model is never taken to zero."""
from __future__ import annotations

from dataclasses import replace

import pytest

from shared.events.plan import ScaleDown
from shared.planner.arbiter_capacity import capacity_offers, drain_s
from shared.planner.arbiter_offers import chance_needed, find_needs, load_s
from shared.planner.policy import Busy
from shared.policy import memory_market as market
from tests.arbiter_views import LIKELY, MIB, MODELS, UNLIKELY, Stub, arbiter, cluster, forecast, pricing, request, worker


def _view(p_forecast, p_instances: int = 2, p_busy: bool = False):
    """m's one instance (w1) full with requests queued for m at the dispatchers; p on `p_instances` workers."""
    base = cluster(p_forecast=p_forecast)
    workers = {"w1": base.workers["w1"]}
    for k in range(p_instances):
        reqs = (request(f"q{k}", 4 * MIB),) if p_busy else ()
        w = worker(f"w{k + 2}", "p", used=100 if p_busy else 0, requests=reqs)
        if p_busy:
            w = replace(w, instances=(replace(w.instances[0], tokens_per_s=10.0),))
        workers[w.worker_id] = w
    return replace(base, workers=workers, queued={"m": 5})


def _model_need(view):
    needs = [n for n in find_needs(view, pricing().settings) if n.scope == "model:m"]
    assert len(needs) == 1
    return needs[0]


def test_an_under_loaded_models_instance_is_offered_at_the_one_eviction_price() -> None:
    view, p = _view(UNLIKELY), pricing()
    need = _model_need(view)
    offers = capacity_offers(view, p, need)
    assert [o.decision.action for o in offers] == [
        ScaleDown(instance_id=f"w{k}-p", worker_id=f"w{k}", model="p") for k in (2, 3)]
    # the arrivals the victim would have served (p's over its 2 instances), for the need's duration and a restart
    evict = market.price_capacity_eviction(chance_needed(view, "p", p.settings, fewer=1), UNLIKELY.avg_rps / 2,
                                           load_s(p, MODELS["p"].weight_bytes), need.lasts_s, p.settings.horizon_s)
    start = load_s(p, MODELS["m"].weight_bytes)  # nothing of m is warm on w2; p's instance holds nothing: no drain
    for o in offers:
        assert o.after_s == pytest.approx(start)
        assert o.price == pytest.approx(market.price_scale_out(start, need.waiting, evict))
        assert o.bytes > 0


def test_a_model_likely_to_need_its_instances_is_dear_to_take_and_a_last_instance_is_never_offered() -> None:
    p = pricing()
    cheap = capacity_offers(_view(UNLIKELY), p, _model_need(_view(UNLIKELY)))[0].price
    dear = capacity_offers(_view(LIKELY), p, _model_need(_view(LIKELY)))[0].price
    assert dear > cheap
    one = _view(UNLIKELY, p_instances=1)
    assert capacity_offers(one, p, _model_need(one)) == []


def test_a_victim_is_charged_its_arrivals_for_as_long_as_the_need_holds_it() -> None:
    # taken, p's instance serves no request until a restart after m's need is over: a longer need is dearer by
    # the arrivals it would have served over the longer span (before: charged over the restart alone), up to the
    # horizon (then they would buy an instance back)
    view, p = _view(LIKELY), pricing()
    need = _model_need(view)
    h = p.settings.horizon_s
    short, long, longest = (capacity_offers(view, p, replace(need, duration_s=d))[0].price for d in (2.0, 9.0, 300.0))
    chance, cold = chance_needed(view, "p", p.settings, fewer=1), load_s(p, MODELS["p"].weight_bytes)
    assert chance > 0 and h == 10.0
    assert long - short == pytest.approx(market.price_capacity_eviction(chance, LIKELY.avg_rps / 2, cold, 9.0, h)
                                         - market.price_capacity_eviction(chance, LIKELY.avg_rps / 2, cold, 2.0, h))
    assert long > short
    assert longest == pytest.approx(capacity_offers(view, p, replace(need, duration_s=h))[0].price)


def test_a_busy_victim_is_priced_with_its_drain_first() -> None:
    view, p = _view(UNLIKELY, p_busy=True), pricing()
    inst = view.workers["w2"].instances[0]
    inst = replace(inst, requests=(replace(inst.requests[0], projected_kv_bytes=8 * MIB),))
    view = replace(view, workers={**view.workers, "w2": replace(view.workers["w2"], instances=(inst,))})
    # 4 MiB of KV left at 32 KiB a token = 128 tokens, at 1 running / 10 tokens/s
    assert drain_s(view, inst, 16) == pytest.approx(12.8)
    offer = next(o for o in capacity_offers(view, p, _model_need(view)) if o.decision.action.worker_id == "w2")
    assert offer.after_s == pytest.approx(12.8 + load_s(p, MODELS["m"].weight_bytes))


def test_the_arbiter_buys_the_scale_down_for_the_queued_model_when_it_beats_waiting() -> None:
    # no mechanism proposes anything: the only cover for m's queue is another model's capacity
    view = _view(forecast("p", 0.0, 0.1))
    arb = arbiter(Stub("mech", []))
    decisions = arb.decide(view, Busy(()))
    downs = [d.action for d in decisions if isinstance(d.action, ScaleDown)]
    assert len(downs) == 1 and downs[0].model == "p"
    (purchase,) = [x for x in arb.take_purchases([]) if x.scope == "model:m"]
    assert [x.source for x in purchase.prices if x.bought] == ["scale_out"]
    # p forecast to need both its instances: the eviction is dear, and m's requests wait instead
    busy_p = _view(forecast("p", 40.0, 60.0, rps=50.0))
    assert not [d for d in arbiter(Stub("mech", [])).decide(busy_p, Busy(())) if isinstance(d.action, ScaleDown)]

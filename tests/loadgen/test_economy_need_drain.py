"""The simulator's need drain (loadgen/sim/economy_arbiter.py): what running requests free as they end is
spread over the time until they end, or over the horizon for one that ends within it — a request one step
from its end frees its KV once, not at KV / step (issue 32: at 25 req/s seed 2 that read ~30-110 GB/s, so
every need looked over within the horizon and no start ever covered one)."""
from __future__ import annotations

import pytest

from loadgen.sim.request import SimRequest
from shared.policy.memory_market import Offer, need_duration_s
from tests.loadgen.test_economy_sim import _decoding, _hand_sim


def test_requests_ending_within_the_horizon_drain_their_kv_over_the_horizon():
    sim = _hand_sim("arbiter")
    a, _ = sim.instances["llama2-7b-0"]
    w, m = a.engine, sim.models["llama2-7b-0"]
    reqs = _decoding(sim, a, 4, prompt=1000, output=2)  # one token left each: they end at the next step
    w.used = w.total  # full: a need
    w.blocked_on = "memory"
    need = sim.arbiter.need(a, 0.0)
    assert need is not None and w.step_s() < sim.horizon_s
    kv = sum((r.prompt + r.output) * m.kv_bytes_per_token for r in reqs)
    assert need.drain_bytes_per_s == pytest.approx(kv / sim.horizon_s, rel=0.05)
    assert need.drain_bytes_per_s < kv / w.step_s() / 10  # not each one's KV per step


def test_long_generations_drain_over_their_remaining_time():
    sim = _hand_sim("arbiter")
    a, _ = sim.instances["llama2-7b-0"]
    w, m = a.engine, sim.models["llama2-7b-0"]
    _decoding(sim, a, 2, prompt=1000, output=20_000)
    w.used = w.total
    w.blocked_on = "memory"
    need = sim.arbiter.need(a, 0.0)
    left = 20_000 - 1 - 1  # generated one at the prefill, one step since
    assert need.drain_bytes_per_s > 0
    assert need.drain_bytes_per_s <= 2 * (1000 + 20_000) * m.kv_bytes_per_token / (left * w.step_s()) * 1.05


def test_a_need_lasts_while_the_models_arrivals_bring_more_kv_than_its_requests_free():
    # issue 32: the need's duration counted only its running requests' ends; under a steady stream of arrivals the
    # need outlives them (106 of 133 start offers in the popularity shift covered none of a need read as over)
    sim = _hand_sim("arbiter")
    a, _ = sim.instances["llama2-7b-0"]
    w, m = a.engine, sim.models["llama2-7b-0"]
    _decoding(sim, a, 4, prompt=1000, output=200)  # they end within the horizon: the drain frees the need in it
    w.used = w.total
    w.blocked_on = "memory"
    alone = sim.arbiter.need(a, 0.0)
    assert alone is not None and alone.duration_s == sim.horizon_s
    # the model's arrivals: 10 in the horizon, each coming to hold 100 + 3,000 tokens, spread over its 2 instances
    for j in range(10):
        sim._arrive(SimRequest(15_000 + j, f"arr-{j}", "llama2-7b-0", None, 0.5, 100, 3000), 0.5)
    inflow = sim.arbiter.inflow(a, 0.5)
    assert inflow == pytest.approx(10 * 3100 * m.kv_bytes_per_token / sim.horizon_s / 2)
    fed = sim.arbiter.need(a, 0.5)
    assert fed is not None and inflow > fed.drain_bytes_per_s  # arrivals bring more than its requests free
    assert fed.duration_s == max(sim.horizon_s, sim.window_s)  # so it lasts the forecast window
    # a start that lands within the window now covers part of it (it covered none of a need over in the horizon)
    start = Offer("scale_out", "s", fed.bytes, 1.0, after_s=2 * sim.horizon_s)
    assert start.cover(alone.lasts_s) == 0.0 and start.cover(fed.lasts_s) > 0.9
    assert need_duration_s(fed.bytes, fed.drain_bytes_per_s, 0.0, sim.horizon_s, sim.window_s) < fed.duration_s


def test_arrivals_past_the_horizon_bring_nothing():
    sim = _hand_sim("arbiter")
    a, _ = sim.instances["llama2-7b-0"]
    sim.served_by = [-1] * 20_000
    sim._arrive(SimRequest(15_100, "old", "llama2-7b-0", None, 0.0, 100, 3000), 0.0)
    assert sim.arbiter.inflow(a, 0.0) > 0
    assert sim.arbiter.inflow(a, sim.horizon_s + 1.0) == 0.0

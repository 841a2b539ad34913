"""The simulator's need drain (loadgen/sim/economy_arbiter.py): what running requests free as they end is
spread over the time until they end, or over the horizon for one that ends within it — a request one step
from its end frees its KV once, not at KV / step (issue 32: at 25 req/s seed 2 that read ~30-110 GB/s, so
every need looked over within the horizon and no start ever covered one)."""
from __future__ import annotations

import pytest

from tests.loadgen.test_economy_sim import _decoding, _hand_sim


def test_requests_ending_within_the_horizon_drain_their_kv_over_the_horizon():
    sim = _hand_sim("arbiter")
    a, _ = sim.instances["llama2-7b-0"]
    w, m = a.engine, sim.models["llama2-7b-0"]
    reqs = _decoding(sim, a, 4, prompt=1000, output=2)  # one token left each: they end at the next step
    w.used = w.total  # full: a need
    w.blocked_on = "memory"
    need = sim._need(a, 0.0)
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
    need = sim._need(a, 0.0)
    left = 20_000 - 1 - 1  # generated one at the prefill, one step since
    assert need.drain_bytes_per_s > 0
    assert need.drain_bytes_per_s <= 2 * (1000 + 20_000) * m.kv_bytes_per_token / (left * w.step_s()) * 1.05

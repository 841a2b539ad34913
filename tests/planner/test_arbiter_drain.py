"""The arbiter's measured drain (shared/planner/arbiter_drain.py): KV released by requests gone between views,
per second over the horizon, fed into the needs instead of `kv_used / request_time_s`."""
from __future__ import annotations

import pytest

from shared.events.predict import Forecast
from shared.planner.arbiter_drain import DrainMeter
from shared.planner.arbiter_offers import ArbiterSettings, inflow, worker_need
from shared.planner.view import ClusterView, InstanceView, RequestView, WorkerView

MiB = 1 << 20


def view(now: float, held: dict[str, int], waiting: int = 0) -> ClusterView:
    reqs = tuple(RequestView(rid, kv_bytes=b) for rid, b in held.items())
    used = sum(held.values()) // MiB
    inst = InstanceView("i1", "m", "w1", running=len(reqs), waiting=waiting, queued_prompt_tokens=64 * waiting,
                        kv_blocks_total=100, kv_blocks_used=used, kv_block_bytes=MiB, requests=reqs)
    w = WorkerView("w1", pool_capacity_bytes=100 * MiB, instances=(inst,))
    return ClusterView(now=now, workers={"w1": w})


def test_the_drain_is_what_requests_gone_since_the_last_view_held_per_second():
    meter = DrainMeter(window_s=10.0)
    assert meter.observe(view(0.0, {"a": 30 * MiB, "b": 40 * MiB, "c": 20 * MiB})) == {}  # seen once: no measure
    got = meter.observe(view(2.0, {"b": 41 * MiB, "c": 21 * MiB, "d": 5 * MiB}))  # a (30 MiB) finished
    assert got == {"i1": pytest.approx(30 * MiB / 2.0)}  # over the 2 s observed, shorter than the window
    got = meter.observe(view(12.0, {"d": 6 * MiB}))  # b and c (62 MiB) at 12 s; a's release left the window
    assert got == {"i1": pytest.approx(62 * MiB / 10.0)}
    got = meter.observe(view(30.0, {"d": 6 * MiB}))
    assert got == {"i1": 0.0}  # nothing released in the last 10 s: it drains nothing
    meter.observe(ClusterView(now=31.0))
    with pytest.raises(KeyError):
        meter.drain("i1", 32.0)  # gone from the view: forgotten
    with pytest.raises(ValueError):
        DrainMeter(0.0)


def test_a_need_prices_waiting_with_the_measured_drain_not_the_constant():
    s = ArbiterSettings(horizon_s=10.0, request_time_s=2.0, batch_size=8)
    v = view(2.0, {"b": 95 * MiB}, waiting=4)
    w = v.workers["w1"]
    assert worker_need(v, w, s).drain_bytes_per_s == pytest.approx(95 * MiB / 2.0)  # the old estimate
    assert worker_need(v, w, s, drains={"i1": 3.0 * MiB}).drain_bytes_per_s == pytest.approx(3.0 * MiB)
    assert worker_need(v, w, s, drains={}).drain_bytes_per_s == pytest.approx(95 * MiB / 2.0)  # not yet measured


def test_a_need_lasts_while_its_models_forecast_arrivals_bring_more_kv_than_it_drains():
    # issue 32: arrivals keep a need alive (the simulator's need too): its duration is its bytes over the drain net
    # of the KV the model's forecast arrivals bring (rate x mean prompt and output tokens x KV per token)
    s = ArbiterSettings(horizon_s=10.0, request_time_s=2.0, batch_size=8)
    per_token = MiB / 16  # one layer's block of 16 tokens is 1 MiB

    def with_forecast(rps: float) -> ClusterView:
        v = view(2.0, {"b": 95 * MiB}, waiting=4)
        fc = Forecast(model="m", predictor_id="p", issued_ts=0.0, window_start_ts=0.0, window_s=60.0, avg_rps=rps,
                      peak_rps=rps, avg_prompt_tokens=100.0, avg_output_tokens=400.0)
        return ClusterView(now=v.now, workers=v.workers, forecasts={"m": fc})

    drains = {"i1": 3.0 * MiB}
    plain = view(2.0, {"b": 95 * MiB}, waiting=4)
    need = worker_need(plain, plain.workers["w1"], s, drains=drains)
    assert need.bytes == 21 * MiB and need.duration_s == 10.0  # 7 s at 3 MiB/s: within the horizon
    assert inflow(plain, plain.workers["w1"].instances, s) == 0.0  # no forecast: the drain alone, as before
    busy = with_forecast(1.0)  # 500 tokens x 64 KiB a second: 31 MiB/s, more than it drains
    assert inflow(busy, busy.workers["w1"].instances, s) == pytest.approx(500 * per_token)
    assert worker_need(busy, busy.workers["w1"], s, drains=drains).duration_s == s.window_s
    light = with_forecast(0.05)  # 1.56 MiB/s in: it drains 1.44 MiB/s net
    assert worker_need(light, light.workers["w1"], s, drains=drains).duration_s == \
        pytest.approx(21 * MiB / (3.0 * MiB - 0.05 * 500 * per_token))

"""The live predictor publishes the spike-guarded forecast (shared/policy/forecast_guard.py), as the simulator reads.

A real predictor process on a real nats-server; this test is the dispatcher: it publishes `DispatchStats`
for one model at a low rate, then at five times it (a level shift). Each published `Forecast` is checked
against the forecast recomputed from the history the predictor stored in JetStream (the windows before the
one forecast): the guarded ensemble's avg and peak (raised to the avg) and their quantiles — and at least
one forecast after the shift is one the guard moved (the unguarded ensemble would have said less).
Whatever the box's load does to the windows' counts, both sides read the same stored windows.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from service_procs import FAST_LIVENESS, ServiceProcess, eventually, wait_ready, write_config
from services.predictor.actor import ensemble_params
from services.predictor.windows import ModelHistory
from shared.bus import Bus, BusSettings, Delivery
from shared.config import load_config
from shared.events import Forecast
from shared.events.dispatch import DispatchStats, ModelLoad
from shared.policy.forecast_ensemble import ensemble_at
from shared.policy.forecast_guard import GuardParams, guarded_at
from shared.policy.forecast_outlook import at_least
from shared.subjects import CATALOG, PREDICTOR_BUCKET, dispatch_stats

pytestmark = pytest.mark.timeout(150)

CONFIG = FAST_LIVENESS + """
[dispatcher]
stats_interval = "250ms"

[predictor]
window = "1s"
season = "4s"
peak_slot = "250ms"
lookback = 2

[[models]]
name = "m"
path = "/nowhere/m"
"""

LOW, HIGH = 1, 5  # arrivals per 250 ms interval: 4 rps, then 20 rps
LOW_WINDOWS = 10


async def test_published_forecasts_are_the_guarded_ensemble_and_the_guard_acts_after_a_shift(nats_url, tmp_path) -> None:
    config_path = write_config(tmp_path, CONFIG)
    config = load_config(config_path)
    params, guard = ensemble_params(config), GuardParams()
    predictor = ServiceProcess("predictor", nats_url, config_path, "predictor-g1").start()
    bus = await Bus.connect(BusSettings(url=nats_url), service="dispatcher")
    forecasts: list[Forecast] = []

    async def on_forecast(msg: Forecast, _ctx: Delivery) -> None:
        if msg.model == "m":
            forecasts.append(msg)

    async def dispatcher(stop: asyncio.Event, shift_at: list[float]) -> None:
        while not stop.is_set():
            n = HIGH if shift_at and time.time() >= shift_at[0] else LOW
            await bus.publish(dispatch_stats(), DispatchStats(
                dispatcher_id="d-test", ts=time.time(), interval_s=0.25,
                models=[ModelLoad(model="m", arrivals=n, admitted=n)]))
            await asyncio.sleep(0.25)

    async def history() -> ModelHistory:
        bucket = await bus.kv(PREDICTOR_BUCKET, ModelHistory, create=False)
        entry = await bucket.get("h.m")
        assert entry is not None
        return entry.value

    stop = asyncio.Event()
    shift_at: list[float] = []
    sender = None
    try:
        await bus.subscribe(CATALOG["predict.forecast"].wildcard, Forecast, on_forecast)
        await wait_ready(bus, predictor)
        sender = asyncio.create_task(dispatcher(stop, shift_at))

        async def low_level_seen():
            return len([f for f in forecasts if (f.observed_rps or 0) > 0]) >= LOW_WINDOWS or None

        await eventually(low_level_seen, timeout=60)
        shift_at.append(time.time())
        checked: dict[int, float] = {}  # window -> lam of the published forecast

        async def guard_acted():
            h = await history()
            for f in list(forecasts):
                w = round(f.window_start_ts / f.window_s) - h.first_window
                if w in checked or w > len(h.avg):
                    continue
                avg, lam = guarded_at(h.avg[:w], w, params, guard)
                peak, _ = guarded_at(h.peak[:w], w, params, guard)
                assert f.avg_rps == pytest.approx(avg.point, rel=1e-9, abs=1e-9), (w, f, h.avg[:w])
                assert f.peak_rps == pytest.approx(at_least(peak, avg).point, rel=1e-9, abs=1e-9)
                assert f.avg_rps_quantiles is not None
                assert f.avg_rps_quantiles.p50 == pytest.approx(avg.quantile(0.5), rel=1e-9, abs=1e-9)
                assert f.avg_rps_quantiles.p90 == pytest.approx(avg.quantile(0.9), rel=1e-9, abs=1e-9)
                checked[w] = lam
                raw = ensemble_at(h.avg[:w], w, params).point
                if f.issued_ts > shift_at[0] and lam > 0 and f.avg_rps > raw + 1.0:
                    return w
            return None

        acted = await eventually(guard_acted, timeout=60, interval=0.5)
        assert len(checked) >= LOW_WINDOWS, checked
        assert acted in checked and checked[acted] > 0
        assert "Traceback" not in predictor.log(), predictor.log()[-3000:]
    finally:
        stop.set()
        if sender is not None:
            await sender
        await bus.close()
        predictor.stop()

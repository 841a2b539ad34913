"""The predictor as a real process on a real NATS, fed by a real dispatcher.

Requests for a catalog model with no instance are refused by the dispatcher (no capacity) and
counted in its `DispatchStats`; the predictor turns them into windows, stores them in JetStream
and publishes forecasts. It is then SIGKILLed and restarted: the windows it had closed are still
there, and the first forecast after the restart (no new traffic) still comes from them.
"""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from service_procs import FAST_LIVENESS, ServiceProcess, eventually, wait_ready, write_config
from services.predictor.windows import ModelHistory
from shared.bus import Bus, BusSettings, Delivery
from shared.events import Forecast, SamplingParams, SubmitReply, SubmitRequest
from shared.subjects import CATALOG, PREDICTOR_BUCKET, dispatch_stats, dispatch_submit

pytestmark = pytest.mark.timeout(150)

CONFIG = FAST_LIVENESS + """
[dispatcher]
stats_interval = "250ms"

[predictor]
window = "2s"
season = "8s"
peak_slot = "500ms"
lookback = 3

[[models]]
name = "busy"
path = "/nowhere/busy"

[[models]]
name = "idle"
path = "/nowhere/idle"
"""


async def test_forecasts_from_dispatcher_admissions_and_history_survives_a_kill(nats_url, tmp_path) -> None:
    config = write_config(tmp_path, CONFIG)
    dispatcher = ServiceProcess("dispatcher", nats_url, config, "dispatcher-p1").start()
    predictor = ServiceProcess("predictor", nats_url, config, "predictor-p1").start()
    bus = await Bus.connect(BusSettings(url=nats_url), service="gateway")
    forecasts: list[Forecast] = []

    async def on_forecast(msg: Forecast, _ctx: Delivery) -> None:
        forecasts.append(msg)

    async def load(stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            msg = SubmitRequest(request_id=f"r{n}", model="busy", prompt_token_ids=[1, 2, 3],
                                sampling=SamplingParams(max_tokens=4), arrival_ts=time.time())
            await bus.request(dispatch_submit(), msg, SubmitReply, timeout=3.0)
            await asyncio.sleep(0.05)

    try:
        await bus.subscribe(CATALOG["predict.forecast"].wildcard, Forecast, on_forecast)
        await wait_ready(bus, dispatcher)
        await wait_ready(bus, predictor)
        await bus.nc.publish(dispatch_stats(), b"\xc1 not msgpack")  # skipped and counted, nothing else
        stop = asyncio.Event()
        sender = asyncio.create_task(load(stop))

        def busy_seen(k: int):
            async def check():
                seen = [f for f in forecasts if f.model == "busy" and (f.observed_rps or 0) > 0]
                # the first forecasts after the load starts may still come from windows closed before
                # it (avg 0): wait for one made from a closed window that saw the traffic
                return seen if len(seen) >= k and seen[-1].avg_rps > 0 else None
            return check

        seen = await eventually(busy_seen(3), timeout=40)
        stop.set()
        await sender
        last = seen[-1]
        assert last.avg_rps > 0 and last.peak_rps >= last.avg_rps
        # the ensemble: its members' weights, P50 <= P90, and the concurrency (the dispatcher's queue, sampled:
        # no instance and no scale from zero, so every request is refused at once and none waits)
        assert {m.name for m in last.members} >= {"csp", "last_value", "ewma"}
        assert abs(sum(m.weight for m in last.members) - 1.0) < 1e-9
        assert last.avg_rps_quantiles is not None and last.avg_rps_quantiles.p50 <= last.avg_rps_quantiles.p90
        assert last.avg_concurrency == 0.0 and last.concurrency_quantiles is not None
        assert last.window_s == 2.0 and last.window_start_ts % 2.0 == 0
        assert last.predictor_id == "predictor-p1"
        idle = [f for f in forecasts if f.model == "idle"]
        assert idle and idle[-1].avg_rps == 0.0  # a catalog model nobody asked for: forecast 0

        assert predictor.stop(signal.SIGKILL) == -signal.SIGKILL
        bucket = await bus.kv(PREDICTOR_BUCKET, ModelHistory, create=False)
        before = (await bucket.get("h.busy")).value  # type: ignore[union-attr]
        observed_before = [v for v in before.avg if v]
        assert len(observed_before) >= 3

        forecasts.clear()
        restarted = ServiceProcess("predictor", nats_url, config, "predictor-p2").start()
        predictor = restarted
        await wait_ready(bus, restarted)

        async def busy_after_restart():
            return next((f for f in forecasts if f.model == "busy" and f.predictor_id == "predictor-p2"), None)

        first = await eventually(busy_after_restart, timeout=30)
        assert first.avg_rps > 0  # no request since the kill: only the stored windows can say so
        after = (await bucket.get("h.busy")).value  # type: ignore[union-attr]
        assert after.first_window == before.first_window
        assert after.avg[:len(before.avg)] == before.avg  # every stored window kept as it was
        assert None in after.avg[len(before.avg):] or len(after.avg) > len(before.avg)
        assert "Traceback" not in restarted.log(), restarted.log()[-3000:]
    finally:
        await bus.close()
        for proc in (predictor, dispatcher):
            proc.stop()

"""WarmServe live: gateway, dispatcher (`scale_from_zero`), planner (`autoscale`), predictor, registry and two
gpu_worker processes. Forecasts are published on `tidal.v1.predict.<model>` as an external predictor would
(the predictor service runs too, with a one-day window, so it publishes none meanwhile).

1. The idle qwen model is scaled down by the autoscaler (its load stays below half its capacity past the
   protect period): EvictModel drains it and w1 keeps its weights warm (universal, in the registry's
   WorkerRecord.lifecycle).
2. A peak forecast for the llama model prewarms a burst replica of it on w1 (Alg. 1: w1 is the only
   candidate without llama; PlacePrewarm -> Prewarm reads the checkpoint once).
3. Twelve requests of llama at a time (B = 8: above 0.8 x B) make the autoscaler start a second llama
   instance on w1, which holds it warm: the start opens no checkpoint file
   (tidal_worker_checkpoint_opens_total on w1 is unchanged), and llama answers token-exact.
4. The qwen model, scaled to zero, gets its first request answered (queued, started again, token-exact).
"""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import pytest

from e2e.assets import LLAMA, QWEN, Oracle
from e2e.cluster import ClusterSpec, E2ECluster
from shared.bus import Bus, BusSettings, Delivery
from shared.events.plan import PlacePrewarm, PlanApplied, PlanDecided, PlanEvent, ScaleDown, ScaleUp
from shared.events.predict import Forecast
from shared.events.registry import Bucket
from shared.registry_client import RegistryClient
from shared.subjects import CATALOG, predict_forecast
from tidal.health_probe import gather_health

pytestmark = pytest.mark.timeout(300)

CLUSTER_SPEC = ClusterSpec(
    workers={"w0": [LLAMA], "w1": [QWEN]}, control_plane=True, scale_from_zero=True, metrics=True,
    extra_toml='[planner]\ninterval = "300ms"\nlease_ttl = "1s"\nautoscale = true\nrequest_time = "1s"\n\n'
               '[predictor]\nwindow = "1d"\n',
    # "universal" lasts only while the evicted weights stay warm: the default 30 s grace was missed once on a
    # loaded box (load ~15: the drain, the stats and the planner's registry write came after it had ended)
    worker_toml='grace_period = "120s"\n',
)
PROMPT = "The tide comes in"


def forecast(model: str, avg: float, peak: float) -> Forecast:
    now = time.time()
    return Forecast(model=model, predictor_id="test", issued_ts=now, window_start_ts=now, window_s=600.0,
                    avg_rps=avg, peak_rps=peak)


async def checkpoint_opens(bus: Bus, worker: str) -> float:
    replies = await gather_health(bus, "gpu_worker", timeout=2.0, expect={f"gpu_worker-{worker}-e2e"})
    port = replies[f"gpu_worker-{worker}-e2e"].metrics_port
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                                   .read().decode())
    match = re.search(r"^tidal_worker_checkpoint_opens_total (\S+)$", text, re.M)
    assert match, "the worker exports tidal_worker_checkpoint_opens_total"
    return float(match.group(1))


async def until(what: str, check, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


async def test_forecasts_scale_down_prewarm_and_scale_up_on_warm_weights(cluster: E2ECluster, oracle: Oracle) -> None:
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="test")
    events: list[PlanEvent] = []

    async def on(msg: PlanEvent, _ctx: Delivery) -> None:
        events.append(msg)

    await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on)
    registry = RegistryClient(bus)

    def decided(kind: type, model: str) -> list[PlanDecided]:
        return [e for e in events if isinstance(e, PlanDecided) and isinstance(e.plan.actions[0], kind)
                and e.plan.actions[0].model == model]  # type: ignore[union-attr]

    def applied(plan_id: str) -> bool:
        return any(isinstance(e, PlanApplied) and e.plan_id == plan_id for e in events)

    async def lifecycle(worker: str) -> str | None:
        entry = await registry.get(Bucket.WORKERS, worker)
        return entry.record.lifecycle if entry is not None else None  # type: ignore[union-attr]

    try:
        client = cluster.async_openai(timeout=120.0)
        want = {m: oracle.greedy(m, prompt=PROMPT, max_tokens=8) for m in (LLAMA, QWEN)}

        # 1. qwen idles: the autoscaler drains it after its protect period, w1 keeps the weights warm
        await until("qwen scaled down", lambda: _ready(bool(decided(ScaleDown, QWEN))))
        down = decided(ScaleDown, QWEN)[0]
        assert down.plan.trigger == "idle" and down.plan.actions[0].worker_id == "w1"  # type: ignore[union-attr]
        await until("w1 universal", lambda: _eq(lifecycle("w1"), "universal"), timeout=110.0)

        # 2. a peak for llama: a burst replica is prewarmed on w1 (the only worker not holding llama)
        await bus.publish(predict_forecast(LLAMA), forecast(LLAMA, 2.0, 16.0))  # B = 8, 1 s each: L_P = 16
        await until("llama prewarmed on w1", lambda: _ready(any(
            applied(e.plan.plan_id) and e.plan.actions[0].worker_id == "w1"  # type: ignore[union-attr]
            for e in decided(PlacePrewarm, LLAMA))))
        opens = await checkpoint_opens(bus, "w1")

        # 3. twelve llama requests at a time: above 0.8 x 8 over the window, a second instance starts on w1's warm
        #    weights with no checkpoint read (llama may have idled to zero meanwhile: then the first start is w0's)
        stop = asyncio.Event()

        async def drive() -> None:
            while not stop.is_set():
                await client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=600, temperature=0)

        drivers = [asyncio.create_task(drive()) for _ in range(12)]
        try:
            await until("llama scaled up on w1", lambda: _ready(any(
                applied(e.plan.plan_id) and e.plan.actions[0].worker_id == "w1"  # type: ignore[union-attr]
                for e in decided(ScaleUp, LLAMA))), timeout=90.0)
        finally:
            stop.set()
            await asyncio.gather(*drivers, return_exceptions=True)
        ups = [e for e in decided(ScaleUp, LLAMA) if e.plan.actions[0].worker_id == "w1"]  # type: ignore[union-attr]
        assert len(ups) == 1, [e.plan.reason for e in ups]  # one decision, one LoadModel
        assert "warm" in ups[0].plan.reason and await checkpoint_opens(bus, "w1") == opens
        for _ in range(3):  # token-exact on whichever instance answers
            got = await client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=8, temperature=0)
            assert got.choices[0].text == want[LLAMA].text

        # 4. qwen has no instance: its first request is queued, qwen is started again, the answer is exact
        got = await client.completions.create(model=QWEN, prompt=PROMPT, max_tokens=8, temperature=0)
        assert got.choices[0].text == want[QWEN].text
    finally:
        await bus.close()


async def _eq(value, expect: object) -> bool:  # type: ignore[no-untyped-def]
    return await value == expect


async def _ready(value: bool) -> bool:
    return value

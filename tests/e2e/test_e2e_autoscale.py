"""The autoscaler live, with the default cluster's planner settings (`shared/default_cluster.toml`: planner on,
`autoscale = true`, a 1 s interval, B = `max_batch_size` 64, scale from zero): real gateway, dispatcher, planner,
predictor, registry and two gpu_worker processes, w0 serving the llama model and w1 the qwen one.

The llama model is driven hard (80 requests at a time: above 0.8 x 64 of one instance) while qwen idles. The
autoscaler (shared/policy/autoscaler.py: the 5 s load average over B per instance) moves w1 to llama: a
ScaleUp of llama onto w1 is decided within the window and two intervals (one planner, one stats) of the average
the stats show (held at the workers + queued at the dispatchers, over the autoscaler's window) passing
0.8 x B, it is applied (one LoadModel: no second ScaleUp of llama onto w1, no
failed one), and the idle qwen instance on w1 is drained. Every request is answered.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from e2e.assets import LLAMA, QWEN
from e2e.cluster import ClusterSpec, E2ECluster
from shared.bus import Bus, BusSettings, Delivery
from shared.events import DispatchStats, WorkerStats
from shared.events.plan import PlanApplied, PlanDecided, PlanEvent, PlanFailed, ScaleDown, ScaleUp
from shared.policy.autoscaler import AutoscaleParams, LoadWindow
from shared.subjects import CATALOG, dispatch_stats, worker_stats

pytestmark = pytest.mark.timeout(300)

B = 64  # the default cluster's [policies] max_batch_size
CLUSTER_SPEC = ClusterSpec(
    workers={"w0": [LLAMA], "w1": [QWEN]}, control_plane=True, scale_from_zero=True, max_batch=B, queue_bound=256,
    extra_toml='[planner]\nautoscale = true\n',  # every other [planner] key at its default (interval 1 s)
)
# long requests (600-900 tokens, past EOS): 64 run on the instance, the rest queue at the dispatcher. Each lasts
# longer than the window, so the load is a plateau, not a sawtooth of short requests whose level would be set by
# how fast a busy box lets the clients send the next one
DRIVERS = 80
INTERVAL_S = 1.0  # [planner] interval and [dispatcher] stats_interval defaults


async def test_an_overloaded_model_takes_the_idle_models_worker_within_the_window(cluster: E2ECluster) -> None:
    window = AutoscaleParams().window_s
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="test")
    events: list[tuple[float, PlanEvent]] = []
    # the autoscaler's signal as the stats carry it: llama's requests held at each worker plus those queued at
    # each dispatcher, a step function averaged over the window; load_seen: when that average first passed
    # 0.8 x B (an instant above it is not the signal: a closed loop of equal requests is a sawtooth)
    held: dict[str, int] = {}
    queued: dict[str, int] = {}
    average = LoadWindow(window)
    load_seen: list[float] = []

    def record() -> None:
        now = time.monotonic()
        average.record(now, sum(held.values()) + sum(queued.values()))
        if average.mean(now) > 0.8 * B and not load_seen:
            load_seen.append(now)

    async def on_plan(msg: PlanEvent, _ctx: Delivery) -> None:
        events.append((time.monotonic(), msg))

    async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
        held[msg.worker_id] = sum(i.running + i.waiting for i in msg.instances if i.model == LLAMA)
        record()

    async def on_dispatch(msg: DispatchStats, _ctx: Delivery) -> None:
        queued[msg.dispatcher_id] = sum(m.queued for m in msg.models if m.model == LLAMA and m.adapter is None)
        record()

    await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on_plan)
    await bus.subscribe(worker_stats(), WorkerStats, on_stats)
    await bus.subscribe(dispatch_stats(), DispatchStats, on_dispatch)

    def decided(kind: type, model: str, worker: str | None = None) -> list[tuple[float, PlanDecided]]:
        return [(t, e) for t, e in events if isinstance(e, PlanDecided) and isinstance(e.plan.actions[0], kind)
                and e.plan.actions[0].model == model  # type: ignore[union-attr]
                and (worker is None or e.plan.actions[0].worker_id == worker)]  # type: ignore[union-attr]

    def outcome(plan_id: str, kind: type) -> bool:
        return any(isinstance(e, kind) and e.plan_id == plan_id for _, e in events)

    client = cluster.async_openai(timeout=120.0)
    stop = asyncio.Event()
    answered = 0

    async def drive(k: int) -> None:
        nonlocal answered
        while not stop.is_set():
            # lengths differ, so the 64 running requests do not all end in one step (that load is a sawtooth)
            got = await client.completions.create(model=LLAMA, prompt="The tide comes in",
                                                  max_tokens=600 + (k * 37) % 300, temperature=0,
                                                  extra_body={"ignore_eos": True})
            assert got.choices[0].text
            answered += 1

    started = time.monotonic()
    drivers = [asyncio.create_task(drive(k)) for k in range(DRIVERS)]
    try:
        deadline = started + 120.0
        while not any(outcome(e.plan.plan_id, PlanApplied) for _, e in decided(ScaleUp, LLAMA, "w1")):
            assert time.monotonic() < deadline, f"no ScaleUp of {LLAMA} onto w1 applied: {[e for _, e in events]}"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        results = await asyncio.gather(*drivers, return_exceptions=True)
    try:
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert answered >= DRIVERS
        (at, up), = decided(ScaleUp, LLAMA, "w1")  # one decision, one LoadModel
        assert not outcome(up.plan.plan_id, PlanFailed)
        # within the window (the planner samples once an interval, so its average may trail this one), one
        # planner interval and one stats interval of the stats' load average passing 0.8 x B. Not from the
        # drive's start: how fast 80 clients ramp up through the gateway is the box's speed, not the autoscaler's.
        assert load_seen, f"the stats never showed llama's load average above 0.8 x {B}; decided at {at - started:.1f}s"
        assert at - load_seen[0] <= window + 2 * INTERVAL_S + 1.0, (at - load_seen[0], up.plan.reason)
        # the idle model's instance on w1 is drained (now or before the drive)
        deadline = time.monotonic() + 30.0
        while not decided(ScaleDown, QWEN, "w1"):
            assert time.monotonic() < deadline, "the idle qwen instance on w1 was never drained"
            await asyncio.sleep(0.2)
    finally:
        await bus.close()

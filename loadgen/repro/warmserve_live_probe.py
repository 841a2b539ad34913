"""`tidal repro warmserve --live`: the autoscaler probe, on the prewarm run's cluster after the trace.

The first model (idle by then) is driven hard (`probe_rps` for `probe_s`) while the others idle;
reported: how long after the drive began the autoscaler (shared/policy/autoscaler.py: 0.8 x B per
instance over its 5 s window) decided and applied a scale-out of it, onto which worker and what that
worker held before, and the scale-ups decided for it (one LoadModel per decision: none refused).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from loadgen.repro.warmserve_live_cluster import WarmLiveCluster
from loadgen.traces.schema import TraceRecord

if TYPE_CHECKING:
    from loadgen.repro.warmserve_live import WarmLiveConfig


@dataclass
class ScaleOutProbe:
    model: str
    rps: float
    batch: int
    window_s: float
    requests: int
    lost: int
    decided_s: float | None  # the autoscaler's first scale-out of the model, from the drive's start
    applied_s: float | None
    worker: str = ""
    worker_held: str = ""  # what that worker served or held warm just before
    scale_ups: int = 0  # of the model during the probe, both paths
    refused: int = 0  # of them, failed (e.g. a duplicate LoadModel refused busy)

    def line(self) -> str:
        if self.decided_s is None:
            return (f"live autoscale: {self.model} at {self.rps:g} rps (B={self.batch}): no scale-out in "
                    f"{self.requests} requests")
        applied = f"{self.applied_s:.1f}" if self.applied_s is not None else "-"
        return (f"live autoscale: {self.model} at {self.rps:g} rps (B={self.batch}, window {self.window_s:g} s): "
                f"scale-out decided {self.decided_s:.1f} s after the drive began, applied at {applied} s, onto "
                f"{self.worker} ({self.worker_held}); {self.scale_ups} scale-ups, {self.refused} refused; "
                f"{self.requests - self.lost}/{self.requests} complete")




def probe_trace(cfg: "WarmLiveConfig", model: str) -> list[TraceRecord]:
    """`probe_rps` of one model for `probe_s` (seeded Poisson): the load the autoscaler must scale out for."""
    rng = np.random.default_rng(cfg.seed + 7)
    out, t = [], float(rng.exponential(1 / cfg.probe_rps))
    while t < cfg.probe_s:
        out.append(TraceRecord(arrival_s=round(t, 4), model=model, request_id=f"probe-{len(out)}",
                               prompt_tokens=int(rng.integers(*cfg.prompt_tokens)),
                               output_tokens=int(rng.integers(*cfg.probe_output_tokens))))
        t += float(rng.exponential(1 / cfg.probe_rps))
    return out


async def run_probe(cluster: WarmLiveCluster, cfg: "WarmLiveConfig", model: str, batch: int) -> ScaleOutProbe:
    from loadgen.runner.runner import LoadRunner, RunnerConfig, served_context
    from shared.bus import Bus, BusSettings, Delivery
    from shared.events import WorkerStats
    from shared.events.plan import PlanApplied, PlanDecided, PlanEvent, PlanFailed, ScaleUp
    from shared.planner.view import prewarmed_models
    from shared.policy.autoscaler import AutoscaleParams
    from shared.subjects import CATALOG, worker_stats

    latest: dict[str, WorkerStats] = {}
    ups: dict[str, tuple[float, ScaleUp, str, bool]] = {}  # plan id -> (decided at, action, held, autoscaler)
    applied: dict[str, float] = {}
    failed: set[str] = set()

    async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
        latest[msg.worker_id] = msg

    async def on_plan(msg: PlanEvent, _ctx: Delivery) -> None:
        now = time.perf_counter()
        if isinstance(msg, PlanDecided) and isinstance(msg.plan.actions[0], ScaleUp):
            action = msg.plan.actions[0]
            if action.model == model:
                stats = latest.get(action.worker_id)
                held = "idle"
                if stats is not None:
                    serving = sorted({i.model for i in stats.instances})
                    warm = sorted(prewarmed_models(stats))
                    held = (f"serving {', '.join(serving)}" if serving else "") + \
                        ("; " if serving and warm else "") + (f"warm: {', '.join(warm)}" if warm else "")
                ups[msg.plan.plan_id] = (now, action, held or "idle", msg.plan.reason.startswith("autoscaler:"))
        elif isinstance(msg, PlanApplied):
            applied[msg.plan_id] = now
        elif isinstance(msg, PlanFailed):
            failed.add(msg.plan_id)

    trace = probe_trace(cfg, model)
    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="cli")
    try:
        await bus.subscribe(worker_stats(), WorkerStats, on_stats)
        await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on_plan)
        await asyncio.sleep(2.0)  # the latest stats of every worker
        context = await asyncio.to_thread(served_context, cluster.url)
        started = time.perf_counter()
        outcome = await LoadRunner(trace, RunnerConfig(url=cluster.url, request_timeout_s=120.0),
                                   context=context).run()
        await asyncio.sleep(1.0)  # outcomes still on their way
    finally:
        await bus.close()
    want = {r.request_id: r.output_tokens for r in trace}
    ok = [r for r in outcome.records if r.status == "ok" and r.output_tokens == want.get(r.request_id)]
    mine = {pid: u for pid, u in ups.items() if u[0] >= started}
    first = min((u for pid, u in mine.items() if u[3]), key=lambda u: u[0], default=None)
    first_id = next((pid for pid, u in mine.items() if u is first), None)
    probe = ScaleOutProbe(model=model, rps=cfg.probe_rps, batch=batch, window_s=AutoscaleParams().window_s,
                          requests=len(trace), lost=len(trace) - len(ok), decided_s=None, applied_s=None,
                          scale_ups=len(mine), refused=len(set(mine) & failed))
    if first is not None and first_id is not None:
        probe.decided_s = first[0] - started
        probe.applied_s = applied[first_id] - started if first_id in applied else None
        probe.worker, probe.worker_held = first[1].worker_id, first[2]
    return probe



__all__ = ["ScaleOutProbe", "probe_trace", "run_probe"]

"""`tidal repro warmserve --live`: WarmServe on a local cluster of 4 CPU workers, prewarm on vs off, one run.

1. Five small generated models of different sizes (random weights, a real tokenizer).
2. A seeded trace whose popularity shifts: the run is cut into phases; in each, two models are hot
   (Poisson, `hot_rps` each) and the others see a trickle (`cold_rps`), the hot pair moving on each
   phase — so models scale to zero and come back, the case prewarming is for.
3. The same trace through the gateway twice, each on a fresh cluster: `[policies] prewarm = true`
   (grace-period weights kept, Alg. 1 prewarms, proactive prewarming) and `prewarm = false` (every
   start reads the checkpoint). In both the planner's autoscaler follows each model's load and the
   predictor's forecasts (short windows) drive the prewarms; a model with no instance queues its
   requests until one starts (scale from zero), so the start is part of their TTFT.
4. Per run: P50/P99 TTFT over all requests, requests lost (not ok, or short of their tokens), and the
   prewarm hit rate: the share of scale-ups (the autoscaler's or a capacity request's) decided onto a
   worker whose latest stats held the model's weights warm.
5. Then, on the prewarm run's cluster, the autoscaler probe: the first model (idle by then) is driven
   hard (`probe_rps` for `probe_s`) while the others idle; reported: how long after the drive began the
   autoscaler (shared/policy/autoscaler.py: 0.8 x B per instance over its 5 s window) decided and applied
   a scale-out of it, onto which worker and what that worker held before, and the scale-ups decided for
   it (one LoadModel per decision: none refused).
"""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loadgen.repro.warmserve_live_cluster import WarmLiveCluster, WarmLiveClusterSpec
from loadgen.traces.schema import TraceRecord
from shared.nats_server import free_port

# name -> (arch, layers, hidden) of fp32 weights
MODELS = {"ws-a": ("llama", 2, 128), "ws-b": ("qwen2", 4, 256), "ws-c": ("llama", 4, 384),
          "ws-d": ("qwen2", 6, 512), "ws-e": ("llama", 8, 640)}  # ~1.6 to ~160 MB


@dataclass(frozen=True)
class WarmLiveConfig:
    duration_s: float = 60.0
    phases: int = 4
    hot_rps: float = 1.0
    cold_rps: float = 0.03
    prompt_tokens: tuple[int, int] = (16, 64)
    output_tokens: tuple[int, int] = (8, 16)
    seed: int = 0
    workers: int = 4
    probe_rps: float = 8.0  # the autoscaler probe: the first model at this rate ...
    probe_s: float = 15.0  # ... for this long
    probe_output_tokens: tuple[int, int] = (48, 64)


@dataclass
class RunResult:
    prewarm: bool
    ttft_p50_s: float
    ttft_p99_s: float
    requests: int
    lost: int
    scale_ups: int
    warm_scale_ups: int
    prewarms: int
    scale_downs: int
    wall_s: float
    lost_reasons: list[str] = field(default_factory=list)  # "<request id> <status> <error>"

    @property
    def hit_rate(self) -> float:
        return self.warm_scale_ups / self.scale_ups if self.scale_ups else 0.0


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


@dataclass
class WarmLiveRun:
    config: WarmLiveConfig
    runs: dict[str, RunResult] = field(default_factory=dict)
    wall_s: float = 0.0
    probe: ScaleOutProbe | None = None

    def line(self) -> str:
        on, off = self.runs["prewarm"], self.runs["no-prewarm"]
        ratio = off.ttft_p99_s / on.ttft_p99_s if on.ttft_p99_s > 0 else float("inf")
        line = f"repro warmserve (live): live_p99_ttft_vs_no_prewarm={ratio:.1f}x prewarm_hit={on.hit_rate * 100:.0f}%"
        if self.probe is not None:
            out = f"{self.probe.decided_s:.1f}" if self.probe.decided_s is not None else "none"
            line += f" scale_out_s={out}"
        return line


def shifting_trace(cfg: WarmLiveConfig, models: list[str]) -> list[TraceRecord]:
    """Phase p makes models p and p+1 (mod n) hot; seeded Poisson arrivals per model and phase."""
    rng = np.random.default_rng(cfg.seed)
    span = cfg.duration_s / cfg.phases
    out: list[TraceRecord] = []
    for p in range(cfg.phases):
        hot = {models[p % len(models)], models[(p + 1) % len(models)]}
        for model in models:
            rate = cfg.hot_rps if model in hot else cfg.cold_rps
            t = p * span + rng.exponential(1 / rate)
            while t < (p + 1) * span:
                out.append(TraceRecord(arrival_s=round(t, 4), model=model,
                                       prompt_tokens=int(rng.integers(*cfg.prompt_tokens)),
                                       output_tokens=int(rng.integers(*cfg.output_tokens))))
                t += rng.exponential(1 / rate)
    out.sort(key=lambda r: r.arrival_s)
    return [TraceRecord(arrival_s=r.arrival_s, model=r.model, prompt_tokens=r.prompt_tokens,
                        output_tokens=r.output_tokens, request_id=f"ws-{i}") for i, r in enumerate(out)]


def make_models(root: Path) -> dict[str, Path]:
    from services.gpu_worker.engine.checkpoint_gen import make_model

    out = {}
    for seed, (name, (arch, layers, hidden)) in enumerate(MODELS.items()):
        path = root / name
        if not (path / "config.json").is_file():
            make_model(path, arch=arch, seed=seed, layers=layers, hidden=hidden, heads=4, kv_heads=2,  # type: ignore[arg-type]
                       vocab=512, max_position=512)
        out[name] = path
    return out


def run_live(cfg: WarmLiveConfig, *, root: Path | None = None, progress: Callable[[str], None] = print) -> WarmLiveRun:
    started = time.perf_counter()
    tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="tidal-repro-warmserve-live-")
    base = root or Path(tmp.name)  # type: ignore[union-attr]
    try:
        models = make_models(base / "models")
        names = list(models)
        trace = shifting_trace(cfg, names)
        workers = {f"ws-w{i}": ([names[i]] if i < 2 else []) for i in range(cfg.workers)}  # phase 0's hot pair
        spec = WarmLiveClusterSpec(models=models, workers=workers)
        run = WarmLiveRun(cfg)
        progress(f"live: {len(trace)} requests over {cfg.duration_s:.0f} s, {len(names)} models, {cfg.workers} CPU "
                 f"workers; hot pair shifts every {cfg.duration_s / cfg.phases:.0f} s")
        for name, prewarm in (("prewarm", True), ("no-prewarm", False)):
            cluster = WarmLiveCluster(base / f"cluster-{name}", spec, free_port())
            try:
                cluster.start(prewarm)
                run.runs[name] = asyncio.run(_run(cluster, trace, prewarm))
                if prewarm:
                    run.probe = asyncio.run(_probe(cluster, cfg, names[0], spec.batch))
                    progress(run.probe.line())
            finally:
                cluster.stop()
            r = run.runs[name]
            progress(f"live [{name}]: TTFT p50 {r.ttft_p50_s * 1e3:.0f} ms p99 {r.ttft_p99_s * 1e3:.0f} ms; "
                     f"{r.requests - r.lost}/{r.requests} complete; scale-ups {r.scale_ups} ({r.warm_scale_ups} warm), "
                     f"prewarms {r.prewarms}, scale-downs {r.scale_downs} ({r.wall_s:.0f} s)")
            for why in r.lost_reasons:
                progress(f"live [{name}]: lost {why}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    run.wall_s = time.perf_counter() - started
    return run


async def _run(cluster: WarmLiveCluster, trace: list[TraceRecord], prewarm: bool) -> RunResult:
    from loadgen.runner.runner import LoadRunner, RunnerConfig, served_context
    from shared.bus import Bus, BusSettings, Delivery
    from shared.events import WorkerStats
    from shared.events.plan import PlacePrewarm, PlanDecided, ScaleDown, ScaleUp
    from shared.planner.view import prewarmed_models
    from shared.subjects import plan_event, worker_stats

    latest: dict[str, WorkerStats] = {}
    counts = {"up": 0, "warm": 0, "prewarm": 0, "down": 0}

    async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
        latest[msg.worker_id] = msg

    async def on_plan(msg: PlanDecided, _ctx: Delivery) -> None:
        action = msg.plan.actions[0]
        if isinstance(action, ScaleUp):
            counts["up"] += 1
            stats = latest.get(action.worker_id)
            counts["warm"] += bool(stats is not None and prewarmed_models(stats).get(action.model, 0) > 0)
        elif isinstance(action, PlacePrewarm):
            counts["prewarm"] += 1
        elif isinstance(action, ScaleDown):
            counts["down"] += 1

    bus = await Bus.connect(BusSettings(url=cluster.nats_url), service="cli")
    started = time.perf_counter()
    try:
        await bus.subscribe(worker_stats(), WorkerStats, on_stats)
        await bus.subscribe(plan_event("decided"), PlanDecided, on_plan)
        context = await asyncio.to_thread(served_context, cluster.url)
        outcome = await LoadRunner(trace, RunnerConfig(url=cluster.url, request_timeout_s=120.0), context=context).run()
    finally:
        await bus.close()
    want = {r.request_id: r.output_tokens for r in trace}
    records = outcome.records
    ok = [r for r in records if r.status == "ok" and r.output_tokens == want.get(r.request_id)]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    return RunResult(prewarm=prewarm, ttft_p50_s=statistics.median(ttft) if ttft else math.nan,
                     ttft_p99_s=_quantile(ttft, 0.99), requests=len(trace), lost=len(trace) - len(ok),
                     scale_ups=counts["up"], warm_scale_ups=counts["warm"], prewarms=counts["prewarm"],
                     scale_downs=counts["down"], wall_s=time.perf_counter() - started,
                     lost_reasons=[f"{r.request_id} {r.status} {r.output_tokens}/{want.get(r.request_id)} {r.error}"
                                   for r in records if r not in ok][:20])


def probe_trace(cfg: WarmLiveConfig, model: str) -> list[TraceRecord]:
    """`probe_rps` of one model for `probe_s` (seeded Poisson): the load the autoscaler must scale out for."""
    rng = np.random.default_rng(cfg.seed + 7)
    out, t = [], float(rng.exponential(1 / cfg.probe_rps))
    while t < cfg.probe_s:
        out.append(TraceRecord(arrival_s=round(t, 4), model=model, request_id=f"probe-{len(out)}",
                               prompt_tokens=int(rng.integers(*cfg.prompt_tokens)),
                               output_tokens=int(rng.integers(*cfg.probe_output_tokens))))
        t += float(rng.exponential(1 / cfg.probe_rps))
    return out


async def _probe(cluster: WarmLiveCluster, cfg: WarmLiveConfig, model: str, batch: int) -> ScaleOutProbe:
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


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return float(np.quantile(np.asarray(sorted_values), q))



def write_summary(out: Path, run: WarmLiveRun, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "config": asdict(run.config), "wall_s": round(run.wall_s, 1), "line": run.line(),
            "runs": {k: {**asdict(v), "hit_rate": v.hit_rate} for k, v in run.runs.items()},
            "probe": asdict(run.probe) if run.probe is not None else None}
    path = out / "summary-live.json"
    path.write_text(json.dumps(data, indent=2))
    return path


__all__ = ["MODELS", "RunResult", "ScaleOutProbe", "WarmLiveConfig", "WarmLiveRun", "probe_trace", "run_live",
           "shifting_trace", "write_summary"]

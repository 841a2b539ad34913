"""`tidal repro warmserve --live`: WarmServe on a local cluster of 4 CPU workers, prewarm on vs off, N runs.

1. Five small generated models of different sizes (random weights, a real tokenizer).
2. A seeded trace whose popularity shifts: the run is cut into phases; in each, two models are hot
   (Poisson, `hot_rps` each) and the others see a trickle (`cold_rps`), the hot pair moving on each
   phase — so models scale to zero and come back, the case prewarming is for.
3. The same trace through the gateway twice per run, each on a fresh cluster: `[policies] prewarm = true`
   (grace-period weights kept, Alg. 1 prewarms, proactive prewarming) and `prewarm = false` (every
   start reads the checkpoint); `runs` such pairs, the order alternating (on, off, off, on, ...) so the
   box's drift hits both arms alike; the ratio is reported per pair, as a median and its range. In both the planner's autoscaler follows each model's load and the
   predictor's forecasts (short windows) drive the prewarms; a model with no instance queues its
   requests until one starts (scale from zero), so the start is part of their TTFT.
4. Per cluster run: P50/P99 TTFT over all requests, requests lost (not ok, or short of their tokens),
   the prewarm hit rate: the share of scale-ups (the autoscaler's or a capacity request's) decided onto a
   worker whose latest stats held the model's weights warm; and each request's timeline (the worker
   that served it, the starts and prewarms that touched its wait: warmserve_live_timeline.py), written
   as `timeline-<arm>-<run>.json` beside the summary, the slowest three printed.
5. Then, on the first prewarm run's cluster, the autoscaler probe (warmserve_live_probe.py).
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
from loadgen.repro.warmserve_live_probe import ScaleOutProbe, probe_trace, run_probe
from loadgen.repro.warmserve_live_timeline import LiveWatch, describe, slowest, timeline
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
    runs: int = 3  # prewarm / no-prewarm pairs, the order alternating
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
    run: int = 0  # which pair
    slowest: list[str] = field(default_factory=list)  # the slowest requests' timelines, described

    @property
    def hit_rate(self) -> float:
        return self.warm_scale_ups / self.scale_ups if self.scale_ups else 0.0


@dataclass
class WarmLiveRun:
    config: WarmLiveConfig
    pairs: list[dict[str, RunResult]] = field(default_factory=list)  # per run: "prewarm" / "no-prewarm"
    wall_s: float = 0.0
    probe: ScaleOutProbe | None = None

    def ratios(self) -> list[float]:
        """No-prewarm P99 over prewarm P99, per complete pair."""
        out = []
        for pair in self.pairs:
            on, off = pair.get("prewarm"), pair.get("no-prewarm")
            if on is not None and off is not None:
                out.append(off.ttft_p99_s / on.ttft_p99_s if on.ttft_p99_s > 0 else float("inf"))
        return out

    def hit_rate(self) -> float:
        ons = [p["prewarm"] for p in self.pairs if "prewarm" in p]
        ups = sum(r.scale_ups for r in ons)
        return sum(r.warm_scale_ups for r in ons) / ups if ups else 0.0

    def line(self) -> str:
        ratios = self.ratios()
        spread = (f"{statistics.median(ratios):.1f}x({min(ratios):.1f}–{max(ratios):.1f})" if ratios else "n/a")
        line = (f"repro warmserve (live): live_p99_ttft_vs_no_prewarm={spread} runs={len(ratios)} "
                f"prewarm_hit={self.hit_rate() * 100:.0f}%")
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


def run_live(cfg: WarmLiveConfig, *, root: Path | None = None, timelines: Path | None = None,
             progress: Callable[[str], None] = print) -> WarmLiveRun:
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
                 f"workers; hot pair shifts every {cfg.duration_s / cfg.phases:.0f} s; {cfg.runs} runs of both arms")
        for i in range(cfg.runs):
            pair: dict[str, RunResult] = {}
            run.pairs.append(pair)
            order = (("prewarm", True), ("no-prewarm", False))
            for name, prewarm in (order if i % 2 == 0 else order[::-1]):
                cluster = WarmLiveCluster(base / f"cluster-{name}-{i}", spec, free_port())
                try:
                    cluster.start(prewarm)
                    r, lines = asyncio.run(_run(cluster, trace, prewarm))
                    r.run = i
                    pair[name] = r
                    if timelines is not None:
                        timelines.mkdir(parents=True, exist_ok=True)
                        (timelines / f"timeline-{name}-{i}.json").write_text(json.dumps(lines, indent=1))
                    if prewarm and run.probe is None:
                        run.probe = asyncio.run(run_probe(cluster, cfg, names[0], spec.batch))
                        progress(run.probe.line())
                finally:
                    cluster.stop()
                progress(f"live [{name} {i + 1}/{cfg.runs}]: TTFT p50 {r.ttft_p50_s * 1e3:.0f} ms p99 "
                         f"{r.ttft_p99_s * 1e3:.0f} ms; {r.requests - r.lost}/{r.requests} complete; scale-ups "
                         f"{r.scale_ups} ({r.warm_scale_ups} warm), prewarms {r.prewarms}, scale-downs {r.scale_downs} "
                         f"({r.wall_s:.0f} s)")
                for why in r.lost_reasons:
                    progress(f"live [{name} {i + 1}]: lost {why}")
                for slow in r.slowest:
                    progress(f"live [{name} {i + 1}]: slow {slow}")
            ratios = run.ratios()
            if len(ratios) > i:
                progress(f"live run {i + 1}: p99 no-prewarm / prewarm = {ratios[i]:.2f}x")
    finally:
        if tmp is not None:
            tmp.cleanup()
    run.wall_s = time.perf_counter() - started
    return run


async def _run(cluster: WarmLiveCluster, trace: list[TraceRecord], prewarm: bool) -> tuple[RunResult, dict]:
    from loadgen.runner.runner import LoadRunner, RunnerConfig, served_context

    watch = await LiveWatch().start(cluster.nats_url)
    started = time.perf_counter()
    try:
        context = await asyncio.to_thread(served_context, cluster.url)
        outcome = await LoadRunner(trace, RunnerConfig(url=cluster.url, request_timeout_s=120.0), context=context).run()
        await asyncio.sleep(0.5)  # the last plan events on their way
    finally:
        await watch.stop()
    want = {r.request_id: r.output_tokens for r in trace}
    records = outcome.records
    ok = [r for r in records if r.status == "ok" and r.output_tokens == want.get(r.request_id)]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    lines, actions = timeline(watch, outcome, outcome.t0_unix)
    ups = [a for a in actions if a["kind"] == "scale_up"]
    result = RunResult(prewarm=prewarm, ttft_p50_s=statistics.median(ttft) if ttft else math.nan,
                       ttft_p99_s=_quantile(ttft, 0.99), requests=len(trace), lost=len(trace) - len(ok),
                       scale_ups=len(ups), warm_scale_ups=sum(a["warm_bytes"] > 0 for a in ups),
                       prewarms=sum(a["kind"] == "prewarm" for a in actions),
                       scale_downs=sum(a["kind"] == "scale_down" for a in actions),
                       wall_s=time.perf_counter() - started,
                       lost_reasons=[f"{r.request_id} {r.status} {r.output_tokens}/{want.get(r.request_id)} {r.error}"
                                     for r in records if r not in ok][:20],
                       slowest=[describe(line) for line in slowest(lines)])
    return result, {"requests": [asdict(line) for line in lines], "actions": actions}


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return float(np.quantile(np.asarray(sorted_values), q))



def write_summary(out: Path, run: WarmLiveRun, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "config": asdict(run.config), "wall_s": round(run.wall_s, 1), "line": run.line(),
            "ratios": run.ratios(),
            "runs": [{k: {**asdict(v), "hit_rate": v.hit_rate} for k, v in pair.items()} for pair in run.pairs],
            "probe": asdict(run.probe) if run.probe is not None else None}
    path = out / "summary-live.json"
    path.write_text(json.dumps(data, indent=2))
    return path


__all__ = ["MODELS", "RunResult", "ScaleOutProbe", "WarmLiveConfig", "WarmLiveRun", "probe_trace", "run_live",
           "shifting_trace", "write_summary"]

"""`tidal repro economy --live`: the arbiter against the fixed order on a local cluster of CPU workers.

1. Two small generated models; the larger (`econ-a`) carries LoRA adapters (PEFT files, generated)
   and runs on two workers whose pools leave little KV, the smaller (`econ-b`) on a third with room
   to spare (where WarmServe may prewarm `econ-a`).
2. A short `tidal trace mixed` on those names: power-law popularity, Zipf adapters on `econ-a`, one
   burst on `econ-a`, long requests; lengths capped to fit the toy models' context (stated in the
   report).
3. The same trace through the gateway twice, each on a fresh cluster whose configs differ only in
   `[planner] economy` ("fixed-order", then "arbiter"); every mechanism is on in both (buddy groups,
   migration, prewarm with the autoscaler, CPU-assisted cold adapters).
4. Per run: P50/P99 TTFT, requests lost, the plans decided by kind, the purchases (PlanPurchased) by
   source and how each bought offer's effect ended (applied / refused with the worker's code / failed,
   matched by plan id as the planner's purchase log does: shared/planner/purchase_outcomes.py), and each
   worker's pool by kind over time (from its stats) — plotted side by side.
"""
from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loadgen.repro.live_services import LOCAL_CLUSTER_TOML, LiveServices
from loadgen.traces.mixed import generate_mixed
from loadgen.traces.schema import MixedParams, ModelBurst, TraceRecord
from shared.nats_server import free_port

ECONOMIES = ("fixed-order", "arbiter")
MAX_CONTEXT = 512
CONFIG = LOCAL_CLUSTER_TOML + """
[dispatcher]
queue_bound = 1024
scale_from_zero = true
stats_interval = "500ms"

[planner]
interval = "500ms"
ctl_timeout = "30s"
autoscale = true
request_time = "2s"
economy = "{economy}"
consolidate = "on"  # every mechanism on: MELL's consolidation too, under least-load routing

[predictor]
window = "5s"
peak_slot = "1s"
lookback = 2

[policies]
max_batch_size = {batch}
step_token_budget = 256
prewarm = true
buddy_groups = true
migration = "auto"
cpu_lora_assist = true

[observability]
log_level = "warning"
"""


@dataclass(frozen=True)
class EconomyLiveConfig:
    duration_s: float = 60.0
    rate: float = 2.0
    seed: int = 0
    adapters: int = 6
    memory_a: str = "40MiB"  # econ-a's workers: ~32.5 MB of weights, the rest KV and adapters
    memory_b: str = "64MiB"  # econ-b's worker: room for a prewarm of econ-a
    batch: int = 8
    max_prompt: int = 192  # lengths capped to the toy models' context
    max_output: int = 48


@dataclass
class LiveArm:
    economy: str
    ttft_p50_s: float
    ttft_p99_s: float
    requests: int
    lost: int
    plans: dict[str, int]
    purchases: dict[str, int]  # by source bought
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> applied / refused / failed
    refusals: dict[str, int] = field(default_factory=dict)  # refused, by reason (busy, stale, ...)
    in_flight: int = 0  # bought effects with no outcome by the end of the run
    pool: list[tuple[float, str, dict[str, int]]] = field(default_factory=list)  # (t, worker, bytes by kind)
    wall_s: float = 0.0

    def ended(self) -> dict[str, int]:
        """Bought effects by outcome, over every source."""
        out = {"applied": 0, "refused": 0, "failed": 0}
        for by in self.outcomes.values():
            for k, v in by.items():
                out[k] += v
        return out


@dataclass
class EconomyLiveRun:
    config: EconomyLiveConfig
    arms: dict[str, LiveArm] = field(default_factory=dict)
    wall_s: float = 0.0

    def line(self) -> str:
        fixed, arb = self.arms["fixed-order"], self.arms["arbiter"]
        ratio = fixed.ttft_p99_s / arb.ttft_p99_s if arb.ttft_p99_s > 0 else math.inf
        n = arb.ended()
        ended = sum(n.values())
        applied = f"{100 * n['applied'] / ended:.0f}%" if ended else "-"
        return (f"repro economy (live): live_p99_ttft_vs_fixed_order={ratio:.1f}x "
                f"purchases={sum(arb.purchases.values())} applied={applied} refused={n['refused']} "
                f"failed={n['failed']} lost={fixed.lost + arb.lost}")


def live_trace(cfg: EconomyLiveConfig) -> list[TraceRecord]:
    params = MixedParams(seed=cfg.seed, duration_s=cfg.duration_s, rate=cfg.rate, models=["econ-a", "econ-b"],
                         period_s=cfg.duration_s, adapter_models=["econ-a"], adapters_per_model=cfg.adapters,
                         ranks=[8], bursts=[ModelBurst(model="econ-a", start_s=cfg.duration_s / 3, duration_s=15.0,
                                                       magnitude=4.0, ramp_s=1.0)])
    trace = generate_mixed(params)
    return [TraceRecord(arrival_s=r.arrival_s, model=r.model, adapter=r.adapter, request_id=f"econ-{i}",
                        prompt_tokens=max(1, min(r.prompt_tokens, cfg.max_prompt)),
                        output_tokens=max(1, min(r.output_tokens, cfg.max_output)))
            for i, r in enumerate(trace.records)]


def make_assets(root: Path, cfg: EconomyLiveConfig) -> tuple[dict[str, Path], dict[str, Path]]:
    from services.gpu_worker.engine.checkpoint_gen import make_lora, make_model

    models = {}
    for seed, (name, layers) in enumerate((("econ-a", 8), ("econ-b", 4))):
        path = root / name
        if not (path / "config.json").is_file():
            make_model(path, arch="llama", seed=seed, layers=layers, hidden=256, heads=4, kv_heads=2, vocab=512,
                       max_position=MAX_CONTEXT)
        models[name] = path
    width = len(str(max(cfg.adapters - 1, 0)))
    adapters = {}
    for j in range(cfg.adapters):
        name = f"econ-a-lora-{j:0{width}d}"
        path = root / name
        if not (path / "adapter_config.json").is_file():
            make_lora(path, models["econ-a"], rank=8, seed=100 + j)
        adapters[name] = path
    return models, adapters


def config_text(cfg: EconomyLiveConfig, economy: str, data: Path, port: int, models: dict[str, Path],
                adapters: dict[str, Path]) -> str:
    text = CONFIG.format(data=data, port=port, economy=economy, batch=cfg.batch)
    for name, path in models.items():
        text += f'\n[[models]]\nname = "{name}"\npath = "{path}"\ndtype = "float32"\nmax_context = {MAX_CONTEXT}\n'
    for name, path in adapters.items():
        text += (f'\n[[adapters]]\nname = "{name}"\nbase = "econ-a"\npath = "{path}"\nrank = 8\n'
                 f'targets = ["q_proj", "k_proj", "v_proj", "o_proj"]\n')
    for worker, model, memory in (("econ-w0", "econ-a", cfg.memory_a), ("econ-w1", "econ-a", cfg.memory_a),
                                  ("econ-w2", "econ-b", cfg.memory_b)):
        text += (f'\n[[workers]]\nid = "{worker}"\ndevice = "cpu"\nmemory = "{memory}"\nmodels = ["{model}"]\n'
                 f'cpu_lora_processes = 1\nstream_interval = "0s"\ngrace_period = "20s"\n')
    return text


def run_live(cfg: EconomyLiveConfig, *, root: Path | None = None,
             progress: Callable[[str], None] = print) -> EconomyLiveRun:
    started = time.perf_counter()
    tmp = None if root is not None else tempfile.TemporaryDirectory(prefix="tidal-repro-economy-live-")
    base = (root or Path(tmp.name)).resolve()  # type: ignore[union-attr]
    try:
        models, adapters = make_assets(base / "models", cfg)
        trace = live_trace(cfg)
        run = EconomyLiveRun(cfg)
        progress(f"live: {len(trace)} requests over {cfg.duration_s:.0f} s, econ-a (8 layers, {len(adapters)} "
                 f"adapters) on 2 workers of {cfg.memory_a}, econ-b on one of {cfg.memory_b}")
        for economy in ECONOMIES:
            root_e = base / f"cluster-{economy}"
            root_e.mkdir(parents=True, exist_ok=True)
            port = free_port()
            config = root_e / "cluster.toml"
            config.write_text(config_text(cfg, economy, root_e / "data", port, models, adapters))
            services = LiveServices(root_e, config, f"econ-{economy}",
                                    lambda s: "info" if s in ("planner", "gpu_worker") else "warning")
            try:
                services.start_nats()
                services.launch("registry")
                for worker in ("econ-w0", "econ-w1", "econ-w2"):
                    services.launch(f"gpu_worker:{worker}", "--worker-id", worker)
                for name in ("gateway", "dispatcher", "planner", "predictor"):
                    services.launch(name)
                url = f"http://127.0.0.1:{port}"
                services.warm_up(url, list(models), time.monotonic() + 180.0, timeout_s=30.0)
                arm = asyncio.run(_drive(services.nats_url, url, trace, economy))
            finally:
                services.stop()
            run.arms[economy] = arm
            progress(f"live [{economy}]: TTFT p50 {arm.ttft_p50_s * 1e3:.0f} ms p99 {arm.ttft_p99_s * 1e3:.0f} ms; "
                     f"{arm.requests - arm.lost}/{arm.requests} complete; plans {arm.plans}; "
                     f"purchases {arm.purchases}; outcomes {arm.outcomes}, refused by reason {arm.refusals}, "
                     f"{arm.in_flight} in flight ({arm.wall_s:.0f} s)")
    finally:
        if tmp is not None:
            tmp.cleanup()
    run.wall_s = time.perf_counter() - started
    return run


async def _drive(nats_url: str, url: str, trace: list[TraceRecord], economy: str) -> LiveArm:
    from loadgen.runner.runner import LoadRunner, RunnerConfig, served_context
    from shared.bus import Bus, BusSettings, Delivery
    from shared.events import WorkerStats
    from shared.events.plan import PlanDecided, PlanEvent, PlanPurchased
    from shared.planner.effects import effect_kind
    from shared.planner.purchase_outcomes import PurchaseOutcomes
    from shared.subjects import CATALOG, worker_stats

    plans: dict[str, int] = {}
    bought: dict[str, int] = {}
    tally = PurchaseOutcomes()  # each bought offer's effect, by plan id, to how it ended
    pool: list[tuple[float, str, dict[str, int]]] = []
    t0 = time.perf_counter()

    async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
        p = msg.pool
        pool.append((time.perf_counter() - t0, msg.worker_id, {
            "weights": p.weights_bytes, "prewarm": p.prewarm_bytes, "adapter": p.adapter_bytes, "kv": p.kv_bytes,
            "workspace": p.workspace_bytes, "free": p.free_bytes}))

    async def on_plan(msg: PlanEvent, _ctx: Delivery) -> None:
        if isinstance(msg, PlanDecided):
            k = effect_kind(msg.plan)
            plans[k] = plans.get(k, 0) + 1
        elif isinstance(msg, PlanPurchased):
            tally.bought([msg])
            for price in msg.prices:
                if price.bought:
                    bought[price.source] = bought.get(price.source, 0) + 1
        else:  # an effect's outcome: a purchase's, when it bought it
            tally.ended(msg)

    bus = await Bus.connect(BusSettings(url=nats_url), service="cli")
    try:
        await bus.subscribe(worker_stats(), WorkerStats, on_stats)
        await bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on_plan)
        context = await asyncio.to_thread(served_context, url)
        t0 = time.perf_counter()
        outcome = await LoadRunner(trace, RunnerConfig(url=url, request_timeout_s=180.0), context=context).run()
        await asyncio.sleep(1.0)
    finally:
        await bus.close()
    want = {r.request_id: r.output_tokens for r in trace}
    ok = [r for r in outcome.records if r.status == "ok" and r.output_tokens == want.get(r.request_id)]
    ttft = np.array(sorted(r.ttft_s for r in ok if r.ttft_s is not None))
    q = (lambda x: float(np.quantile(ttft, x))) if ttft.size else (lambda x: math.nan)
    refusals: dict[str, int] = {}
    for (_source, how, reason), n in tally.counts.items():
        if how == "refused":
            refusals[reason] = refusals.get(reason, 0) + n
    return LiveArm(economy, q(0.5), q(0.99), len(trace), len(trace) - len(ok), plans, bought,
                   {src: tally.by_outcome(src) for src in sorted(bought)}, refusals, len(tally.open), pool,
                   time.perf_counter() - t0)



def pool_plot(path: Path, run: EconomyLiveRun) -> Path:
    """Each economy's pools summed over the workers, per second (each worker's latest stats by then)."""
    from loadgen.repro.economy_plots import stacked_panels

    kinds = ("weights", "prewarm", "adapter", "kv", "workspace", "free")
    panels = []
    for economy, arm in run.arms.items():
        times = sorted({round(t) for t, _, _ in arm.pool})
        latest: dict[str, dict[str, int]] = {}
        rows = {k: np.zeros(len(times)) for k in kinds}
        samples = sorted(arm.pool, key=lambda s: s[0])
        i = 0
        for j, t in enumerate(times):
            while i < len(samples) and samples[i][0] <= t + 0.5:
                latest[samples[i][1]] = samples[i][2]
                i += 1
            for k in kinds:
                rows[k][j] = sum(v.get(k, 0) for v in latest.values()) / (1 << 20)
        panels.append((f"{economy}: pool by kind (all workers)", np.array(times, dtype=float), rows))
    return stacked_panels(path, panels, kinds, "MiB", "seconds")


def write_live(out: Path, run: EconomyLiveRun, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pool_plot(out / "live_pool_by_kind.png", run)
    data = {"command": command, "config": asdict(run.config), "wall_s": round(run.wall_s, 1), "line": run.line(),
            "arms": {k: {**{f: v for f, v in asdict(a).items() if f != "pool"}, "pool_samples": len(a.pool)}
                     for k, a in run.arms.items()}}
    (out / "summary-live.json").write_text(json.dumps(data, indent=2, default=str))
    lines = ["# The memory economy, live (arbiter vs fixed order)", "", f"Command: `{command}` — "
             f"{run.wall_s:.0f} s wall.", "", "| economy | requests | lost | P50 TTFT ms | P99 TTFT ms | plans | "
             "purchases | outcomes (applied / refused / failed) | refused by reason | in flight |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k, a in run.arms.items():
        outcomes = {src: f"{o['applied']}/{o['refused']}/{o['failed']}" for src, o in a.outcomes.items()}
        lines.append(f"| {k} | {a.requests} | {a.lost} | {a.ttft_p50_s * 1e3:.0f} | {a.ttft_p99_s * 1e3:.0f} | "
                     f"{a.plans} | {a.purchases} | {outcomes} | {a.refusals} | {a.in_flight} |")
    lines += ["", f"`{run.line()}`", "", "![pool](live_pool_by_kind.png)", ""]
    (out / "report-live.md").write_text("\n".join(lines))
    return out / "report-live.md"


def run_live_command(args) -> int:
    import shlex
    import sys

    from loadgen.repro.report import default_out

    cfg = EconomyLiveConfig(duration_s=args.duration or EconomyLiveConfig.duration_s)
    out = Path(args.out) if args.out else default_out("economy-live")
    run = run_live(cfg, root=out / "work", progress=lambda line: print(line, flush=True))
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "economy"] else []
    report = write_live(out, run, ("tidal repro economy " + shlex.join(argv)).strip())
    print(f"report: {report}")
    print(run.line())
    return 0


__all__ = ["ECONOMIES", "EconomyLiveConfig", "EconomyLiveRun", "LiveArm", "config_text", "live_trace",
           "make_assets", "run_live", "run_live_command", "write_live"]

"""`tidal repro mell --live`: MELL on a local cluster of CPU workers, beside the planner off and the simulator.

1. Two small generated models (a llama and a qwen2 layout), each served by its own half of the
   workers (MELL packs one model's requests per device, as the paper; mell_policy's capacity is per
   model), every worker with a tight pool so that a few long requests fill its KV.
2. Two clusters of real processes side by side (nats, registry, gateway, workers, dispatcher, planner,
   `migration = "auto"`): one with the planner off (`[planner] enabled = false`, least-load routing),
   one with MELL on (`mell` routing). They run at the same time so that both see the same CPU: on a
   shared host the speed of a step, hence how long a request holds its KV, drifts from minute to
   minute, and a baseline run a minute apart measures the drift as much as the planner.
3. The cost of a request's life on this CPU is measured first: the trace's opening seconds on both
   (decode seconds per token, prefill per token). Then the fragmenting trace (mell_live_trace.py;
   lengths relative to the KV the workers report) runs through each gateway by the loadgen runner.
   The bus says which workers hold requests, their KV, and the migrations.
4. The simulator runs the same records through the planner core (kv_packing_core) with the measured
   cost; mell_live_report.py compares.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from loadgen.repro.mell_live_cluster import PHASES, LiveCluster, LiveClusterSpec, free_port
from loadgen.repro.mell_live_trace import LiveTraceSpec, SimCost, SimSide, fragmenting_trace, simulate
from loadgen.repro.mell_live_watch import LiveSide, LiveWatch, summarise
from loadgen.report.records import RequestRecord
from loadgen.traces.schema import TraceRecord

MAX_CONTEXT = 4096
MODEL_ARCH = {"mell-a": ("llama", 1), "mell-b": ("qwen2", 2)}


@dataclass(frozen=True)
class LiveConfig:
    trace: LiveTraceSpec = LiveTraceSpec()
    workers_per_model: int = 2
    memory: str = "6MiB"  # ~6000 tokens of KV beside the tiny model's weights and workspace
    interval_s: float = 0.5
    watermark: float = 0.9
    probe_s: float = 6.0  # the trace's first seconds, run once before the phases to measure the cost


@dataclass
class PhaseResult:
    name: str
    side: LiveSide
    records: list[RequestRecord]
    migrations: dict[str, dict[str, int]]  # outcome -> mode -> count
    triggers: dict[str, int]
    wall_s: float

    def lost(self, trace: list[TraceRecord]) -> int:
        """Requests whose stream did not end with every token asked for."""
        want = {r.request_id: r.output_tokens for r in trace}
        ok = {r.request_id for r in self.records if r.status == "ok" and r.output_tokens == want.get(r.request_id)}
        return len(want) - len(ok & set(want))

    def applied(self) -> int:
        return sum(self.migrations.get("applied", {}).values())

    def median_tpot_s(self) -> float:
        tpot = [r.tpot_s for r in self.records if r.status == "ok" and r.tpot_s is not None]
        return statistics.median(tpot) if tpot else float("nan")


@dataclass
class LiveRun:
    config: LiveConfig
    trace: list[TraceRecord]
    capacity_bytes: int  # one worker's KV (what MELL's capacity is a watermark of)
    bytes_per_token: int
    block_tokens: int
    cost: SimCost
    phases: dict[str, PhaseResult] = field(default_factory=dict)
    sim: SimSide | None = None
    wall_s: float = 0.0


def make_models(root: Path) -> dict[str, Path]:
    """The two small checkpoints (random weights, a real tokenizer; `tidal make-model`'s generator)."""
    from services.gpu_worker.engine.checkpoint_gen import make_model

    out = {}
    for name, (arch, seed) in MODEL_ARCH.items():
        path = root / name
        if not (path / "config.json").is_file():
            make_model(path, arch=arch, seed=seed, layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,  # type: ignore[arg-type]
                       max_position=MAX_CONTEXT)
        out[name] = path
    return out


def run_live(cfg: LiveConfig, root: Path, *, progress: Callable[[str], None] = print) -> LiveRun:
    """Everything under `root`: the models, each cluster's config, NATS store and logs (`root/<phase>/logs`)."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.perf_counter()
    root = root.resolve()  # the configs name the checkpoints, and relative paths are the config's
    models = make_models(root / "models")
    names = list(models)
    workers = {f"mell-w{i}": [names[i // cfg.workers_per_model]] for i in range(cfg.workers_per_model * len(names))}
    spec = LiveClusterSpec(models=models, workers=workers, memory=cfg.memory, interval_s=cfg.interval_s,
                           watermark=cfg.watermark, max_context=MAX_CONTEXT)
    clusters = {name: LiveCluster(root / name, spec, free_port()) for name in PHASES}
    progress(f"live: starting two clusters side by side (planner off; MELL), each with {len(workers)} CPU workers "
             f"({cfg.workers_per_model} per model, pool {cfg.memory} each), nats, registry, gateway, dispatcher, planner")
    try:
        with ThreadPoolExecutor(len(clusters)) as pool:
            for done in [pool.submit(c.start, PHASES[name]) for name, c in clusters.items()]:
                done.result()
        run = asyncio.run(_phases(clusters, cfg, spec, progress))
    finally:
        for cluster in clusters.values():
            cluster.stop()
    devices = {m: sum(1 for served in workers.values() if m in served) for m in models}
    run.sim = simulate(run.trace, devices=devices, capacity_bytes=run.capacity_bytes, bytes_per_token=run.bytes_per_token,
                       block_tokens=run.block_tokens, watermark=cfg.watermark, epoch_s=cfg.interval_s, cost=run.cost)
    run.wall_s = time.perf_counter() - started
    return run


async def _phases(clusters: dict[str, LiveCluster], cfg: LiveConfig, spec: LiveClusterSpec,
                  progress: Callable[[str], None]) -> LiveRun:
    """Both clusters at once, so that both share the cores with the same other load (a CPU host's speed
    varies from minute to minute, and a request's life, hence the KV held, with it)."""
    from loadgen.runner.runner import RunnerConfig, served_context

    watches = {name: await LiveWatch().start(c.nats_url) for name, c in clusters.items()}
    try:
        capacity, bpt, block = await _kv_shape(watches["mell"], spec)
        trace = fragmenting_trace(cfg.trace, capacity // bpt)
        contexts = {n: await asyncio.to_thread(served_context, c.url) for n, c in clusters.items()}
        runners = {n: RunnerConfig(url=c.url, seed=cfg.trace.seed, request_timeout_s=300.0) for n, c in clusters.items()}
        costs = await asyncio.gather(*(probe_cost(runners[n], contexts[n], trace, cfg.probe_s) for n in clusters))
        cost = dict(zip(clusters, costs))["mell"]  # the simulator replays MELL's run
        progress(f"live: a worker holds {capacity // bpt} tokens of KV ({bpt} B/token); measured cost (the trace's "
                 f"first {cfg.probe_s:.0f} s on both): decode {cost.decode_step_s * 1e3:.2f} ms/token, prefill "
                 f"{cost.prefill_s_per_token * 1e6:.0f} us/token")
        run = LiveRun(cfg, trace, capacity, bpt, block, cost)
        await asyncio.sleep(2 * cfg.interval_s)  # the probe's last stats and plans go by
        results = await asyncio.gather(*(_run_phase(n, trace, runners[n], contexts[n], watches[n], cfg.interval_s)
                                          for n in clusters))
        for phase in results:
            run.phases[phase.name] = phase
            progress(f"live [{phase.name}]: {len(trace) - phase.lost(trace)}/{len(trace)} streams complete, "
                     f"mean active workers {phase.side.busy().mean():.2f}, migrations applied {phase.applied()}, "
                     f"median {phase.median_tpot_s() * 1e3:.2f} ms/token ({phase.wall_s:.0f} s)")
        return run
    finally:
        for watch in watches.values():
            await watch.stop()


async def _run_phase(name: str, trace: list[TraceRecord], runner, context: dict[str, int],  # type: ignore[no-untyped-def]
                     watch: LiveWatch, tick_s: float) -> PhaseResult:
    from loadgen.runner.runner import LoadRunner

    watch.reset()
    started = time.perf_counter()
    outcome = await LoadRunner(trace, runner, context=context).run()
    end = max((r.record.finish_s or 0.0) for r in outcome.results) if outcome.results else 0.0
    await asyncio.sleep(1.0)  # the stats and plan outcomes of the last moments
    side = summarise(watch.samples, outcome.t0_unix, outcome.t0_unix + end, tick_s)
    migrations = {k: dict(v) for k, v in watch.migrations().items()}
    return PhaseResult(name, side, outcome.records, migrations, dict(watch.triggers), time.perf_counter() - started)


async def _kv_shape(watch: LiveWatch, spec: LiveClusterSpec, timeout_s: float = 30.0) -> tuple[int, int, int]:
    """(one worker's KV bytes as MELL sees it — the smallest instance's, bytes per token, block tokens)."""
    deadline = time.monotonic() + timeout_s
    while set(watch.latest) < set(spec.workers):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no stats from {sorted(set(spec.workers) - set(watch.latest))}")
        await asyncio.sleep(0.1)
    instances = [i for msg in watch.latest.values() for i in msg.instances]
    capacity = min(i.kv_blocks_total * i.kv_block_bytes for i in instances)
    bpt = max(i.kv_block_bytes * (i.layers.end - i.layers.start) // spec.block_tokens for i in instances)
    if capacity <= 0 or bpt <= 0:
        raise RuntimeError(f"the workers report no KV (capacity {capacity} B, {bpt} B/token): raise the pool size")
    return capacity, bpt, spec.block_tokens


async def probe_cost(runner, context: dict[str, int], trace: list[TraceRecord],  # type: ignore[no-untyped-def]
                     window_s: float) -> SimCost:
    """The cost of a request's life under this trace's load on this machine: the trace's first
    `window_s` seconds, sent open loop (planner off) before the measured phases: the median seconds
    per output token, and the median first-token time per prompt token. On a CPU host the workers
    share cores with each other, the gateway and NATS, so a quiet probe (one request alone) would
    put the decode time a few times too low."""
    from loadgen.runner.runner import LoadRunner

    probe = [msgspec.structs.replace(r, request_id=f"probe-{r.request_id}") for r in trace if r.arrival_s < window_s]
    if not probe:
        raise ValueError(f"the trace has no request in its first {window_s} s to measure the cost with")
    records = (await LoadRunner(probe, runner, context=context).run()).records
    tpot = [r.tpot_s for r in records if r.status == "ok" and r.tpot_s is not None]
    prefill = [r.ttft_s / r.prompt_tokens for r in records if r.status == "ok" and r.ttft_s is not None]
    if not tpot or not prefill:
        raise RuntimeError(f"the cost probe failed: {[(r.request_id, r.status, r.error) for r in records]}")
    return SimCost(decode_step_s=statistics.median(tpot), prefill_s_per_token=statistics.median(prefill))


__all__ = ["LiveConfig", "LiveRun", "PhaseResult", "make_models", "probe_cost", "run_live"]

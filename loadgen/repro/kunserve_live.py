"""`tidal repro kunserve --live`: buddy groups on a local cluster of 4 CPU workers, on vs off, one run.

1. One generated 8-layer model (random weights, a real tokenizer) whose weights are most of each
   worker's tight pool: the KV left holds only a few requests, and dropping half the layers frees
   several times that.
2. Two clusters of real processes side by side (`mell_live_cluster.LiveCluster`: nats, registry,
   gateway, 4 gpu_workers with one instance each, dispatcher, planner; MELL's migrations off), whose
   configs differ only in `[policies] buddy_groups`. Side by side, both share the cores with the same
   other load, which on a shared CPU host varies from minute to minute.
3. The burst trace (kunserve_live_trace.py) through each gateway by the loadgen runner, at once: with
   `buddy_groups = true` the planner's KunServe policy forms groups under the burst, drops layers,
   restores and dissolves them in the calm after. Per phase: P50/P99 TTFT,
   TBT (gaps between streamed tokens: `stream_interval = 0s`, one token per chunk), streams lost,
   and KunServe's plan events (`tidal.v1.evt.plan.*`).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadgen.repro.kunserve_live_trace import (
    BurstSpec, LiveHeadline, PhaseFigures, PlanTally, burst_trace, live_headline, phase_figures,
)
from loadgen.repro.live_services import LOCAL_CLUSTER_TOML
from loadgen.repro.mell_live_cluster import LiveCluster, LiveClusterSpec, Phase, free_port
from loadgen.report.records import RequestRecord, write_records
from loadgen.traces.schema import TraceRecord
from shared.config import parse_config

# the phase name decides `buddy_groups`; the planner runs in both (with migration off, only KunServe acts)
PHASES = {"no-groups": Phase("no-groups", planner=True, routing="least_load"),
          "groups": Phase("groups", planner=True, routing="least_load")}
MAX_CONTEXT = 512
CONFIG = LOCAL_CLUSTER_TOML + """
[dispatcher]
queue_bound = 1024
routing_policy = "{routing}"
stats_interval = "250ms"

[planner]
enabled = {planner}
interval = "{interval_ms}ms"
ctl_timeout = "30s"

[policies]
max_batch_size = {batch}
step_token_budget = 256
kv_block_tokens = {block}
migration = "off"
prewarm = false
buddy_groups = {groups}

[observability]
log_level = "warning"
"""


@dataclass(frozen=True)
class KunLiveClusterSpec(LiveClusterSpec):
    """MELL's live-cluster spec with KunServe's config: `buddy_groups` follows the phase's name."""

    def toml(self, phase: Phase, data: Path, port: int) -> str:
        text = CONFIG.format(data=data, port=port, routing=phase.routing, planner=str(phase.planner).lower(),
                             interval_ms=round(self.interval_s * 1000), batch=self.max_batch, block=self.block_tokens,
                             groups=str(phase.name == "groups").lower())
        for name, path in self.models.items():
            text += f'\n[[models]]\nname = "{name}"\npath = "{path}"\ndtype = "float32"\nmax_context = {self.max_context}\n'
        for worker, models in self.workers.items():
            text += (f'\n[[workers]]\nid = "{worker}"\ndevice = "cpu"\nmemory = "{self.memory}"\n'
                     f'models = {json.dumps(models)}\nstream_interval = "0s"\ngrace_period = "0s"\n')
        return text


@dataclass(frozen=True)
class KunLiveConfig:
    trace: BurstSpec = BurstSpec()
    workers: int = 4
    layers: int = 8
    hidden: int = 256
    memory: str = "39MiB"  # ~32.5 MB of weights; the ~3.4 MiB of KV left holds ~430 tokens (2-6 requests)
    max_batch: int = 8
    interval_s: float = 0.5


@dataclass
class KunLiveRun:
    config: KunLiveConfig
    trace: list[TraceRecord]
    phases: dict[str, PhaseFigures] = field(default_factory=dict)
    plans: dict[str, PlanTally] = field(default_factory=dict)
    records: dict[str, list[RequestRecord]] = field(default_factory=dict)
    kv_bytes: dict[str, int] = field(default_factory=dict)  # worker -> KV bytes at idle (before the runs)
    wall_s: float = 0.0

    def headline(self) -> LiveHeadline:
        return live_headline(self.phases["groups"], self.phases["no-groups"])


def make_model(root: Path, cfg: KunLiveConfig) -> Path:
    from services.gpu_worker.engine.checkpoint_gen import make_model as generate

    path = root / cfg.trace.model
    if not (path / "config.json").is_file():
        generate(path, arch="llama", seed=cfg.trace.seed, layers=cfg.layers, hidden=cfg.hidden, heads=4, kv_heads=2,
                 vocab=512, max_position=MAX_CONTEXT)
    return path


def run_live(cfg: KunLiveConfig, root: Path, *, progress: Callable[[str], None] = print) -> KunLiveRun:
    """Everything under `root`: the model, each cluster's config, NATS store and logs (`root/<phase>/logs`)."""
    from concurrent.futures import ThreadPoolExecutor

    started = time.perf_counter()
    root = root.resolve()  # the config names the checkpoint; every process must find it
    workers = {f"kun-w{i}": [cfg.trace.model] for i in range(cfg.workers)}
    spec = KunLiveClusterSpec(models={cfg.trace.model: root / "models" / cfg.trace.model}, workers=workers,
                              memory=cfg.memory, interval_s=cfg.interval_s, max_batch=cfg.max_batch,
                              max_context=MAX_CONTEXT)
    for name, phase in PHASES.items():  # a bad setting (e.g. the memory size) fails here, named, not in a worker
        parse_config(spec.toml(phase, root / name / "data", 8000), source=f"the {name} cluster's config")
    make_model(root / "models", cfg)
    clusters = {name: LiveCluster(root / name, spec, free_port()) for name in PHASES}
    trace = burst_trace(cfg.trace)
    progress(f"live: two clusters side by side (buddy groups off; on), each {cfg.workers} CPU workers of an "
             f"{cfg.layers}-layer model, pool {cfg.memory} each; {len(trace)} requests over {cfg.trace.duration_s:.0f} s "
             f"(burst x{cfg.trace.burst_factor:g} at {cfg.trace.calm_s:g} s for {cfg.trace.burst_s:g} s)")
    run = KunLiveRun(cfg, trace)
    try:
        with ThreadPoolExecutor(len(clusters)) as pool:
            for done in [pool.submit(c.start, PHASES[name]) for name, c in clusters.items()]:
                done.result()
        asyncio.run(_phases(clusters, run, progress))
    finally:
        for cluster in clusters.values():
            cluster.stop()
    run.wall_s = time.perf_counter() - started
    return run


async def _phases(clusters: dict[str, LiveCluster], run: KunLiveRun, progress: Callable[[str], None]) -> None:
    """Both clusters at once, so that both share the cores with the same other load (a CPU host's speed
    varies from minute to minute, and with it how long a burst's requests hold their KV)."""
    from loadgen.runner.runner import RunnerConfig, served_context

    watches = {name: await _PhaseWatch.start(c.nats_url) for name, c in clusters.items()}
    try:
        contexts = {n: await asyncio.to_thread(served_context, c.url) for n, c in clusters.items()}
        await asyncio.sleep(2 * run.config.interval_s)  # the planners' first views; stats of idle workers
        run.kv_bytes = watches["groups"].kv_bytes()
        progress(f"live: KV per worker at idle {min(run.kv_bytes.values(), default=0) / 2**20:.1f} MiB")
        runners = {n: RunnerConfig(url=c.url, seed=run.config.trace.seed, request_timeout_s=300.0)
                   for n, c in clusters.items()}
        results = await asyncio.gather(*(_run_phase(run.trace, runners[n], contexts[n], watches[n]) for n in clusters))
        for name, (records, wall_s) in zip(clusters, results):
            tally = watches[name].tally
            f = run.phases[name] = phase_figures(name, run.trace, records)
            run.records[name], run.plans[name] = records, tally
            progress(f"live [{name}]: {f.requests - f.lost}/{f.requests} streams complete; TTFT p50 "
                     f"{f.ttft_p50_s * 1e3:.0f} ms p99 {f.ttft_p99_s * 1e3:.0f} ms; TBT p50 {f.tbt_p50_s * 1e3:.1f} ms "
                     f"p99 {f.tbt_p99_s * 1e3:.1f} ms; {tally.brief()} ({wall_s:.0f} s)")
            for why in f.lost_reasons + tally.failed[:10]:
                progress(f"live [{name}]: {why}")
    finally:
        for watch in watches.values():
            await watch.stop()


async def _run_phase(trace: list[TraceRecord], runner, context: dict[str, int],  # type: ignore[no-untyped-def]
                     watch: "_PhaseWatch") -> tuple[list[RequestRecord], float]:
    from loadgen.runner.runner import LoadRunner

    started = time.perf_counter()
    outcome = await LoadRunner(trace, runner, context=context).run()
    tally = watch.tally  # after the trace: wait (bounded) for the groups to dissolve, so the tally sees it
    await _settle(lambda: tally.decided["form"] == 0 or tally.applied["dissolve"] >= tally.applied["form"])
    return outcome.records, time.perf_counter() - started


class _PhaseWatch:
    """One cluster's plan events (KunServe's, tallied) and latest worker stats."""

    def __init__(self) -> None:
        self.tally = PlanTally()
        self.latest: dict[str, object] = {}
        self.bus = None

    @classmethod
    async def start(cls, nats_url: str) -> "_PhaseWatch":
        from shared.bus import Bus, BusSettings, Delivery
        from shared.events import WorkerStats
        from shared.events.plan import PlanEvent
        from shared.subjects import CATALOG, worker_stats

        watch = cls()

        async def on_plan(msg: PlanEvent, _ctx: Delivery) -> None:
            watch.tally.add(msg)

        async def on_stats(msg: WorkerStats, _ctx: Delivery) -> None:
            watch.latest[msg.worker_id] = msg

        watch.bus = await Bus.connect(BusSettings(url=nats_url, initial_connect_s=3.0), service="cli")
        await watch.bus.subscribe(CATALOG["plan.event"].wildcard, PlanEvent, on_plan)
        await watch.bus.subscribe(worker_stats(), WorkerStats, on_stats)
        return watch

    def kv_bytes(self) -> dict[str, int]:
        return {w: sum(i.kv_blocks_total * i.kv_block_bytes for i in s.instances)  # type: ignore[attr-defined]
                for w, s in self.latest.items()}

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
            self.bus = None


async def _settle(done: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait (bounded) for the groups to dissolve after the trace, so the tally sees the restore."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.25)


def write_summary(out: Path, run: KunLiveRun, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": command, "config": asdict(run.config), "wall_s": round(run.wall_s, 1),
            "line": run.headline().line(), "requests": len(run.trace), "kv_bytes_idle": run.kv_bytes,
            "phases": {k: asdict(v) for k, v in run.phases.items()},
            "plans": {k: {"decided": dict(v.decided), "applied": dict(v.applied), "failed": v.failed}
                      for k, v in run.plans.items()}}
    for name, records in run.records.items():
        write_records(out / f"records-{name}.jsonl", records)
    path = out / "summary-live.json"
    path.write_text(json.dumps(data, indent=2))
    return path


__all__ = ["KunLiveClusterSpec", "KunLiveConfig", "KunLiveRun", "PHASES", "make_model", "run_live", "write_summary"]

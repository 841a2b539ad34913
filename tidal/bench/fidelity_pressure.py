"""`tidal bench fidelity --pressure`: the simulator against the live engine when KV runs out.

Steps: generate (or take --model) the small llama; fit its profile on this machine (one torch
thread, as the worker runs); size the worker's pool so that its engine has exactly --kv-tokens
of KV (loadgen/profiler/kv_budget.py: the pool less weights, workspace and adapters); start nats
+ registry + dispatcher + gpu_worker(s) + gateway with that pool, --batch, --budget and
`[policies] scheduling = --mode`; calibrate the live path's overheads (as the light check does);
run a Poisson trace open loop while following the workers' stats (their cumulative recompute
preemptions, `InstanceStats.preemptions`); then simulate the same trace with the profile, the
same KV blocks, batch cap and token budget, in the same engine mode. The table compares P50/P99
TTFT, TPOT and E2E, preemptions and the KV peak; the last line is the summary
`bench fidelity: pressure_ttft_p99_err=NN% pressure_tpot_p50_err=NN% preemptions_live=N preemptions_sim=N`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.bench.output import out_dir

if TYPE_CHECKING:
    from tidal.bench.fidelity_compare import Side

BLOCK = 16
# the defaults of a pressure run (the light check's are in fidelity.py's register())
PRESSURE_DEFAULTS = {"workers": 1, "rate": 2.5, "duration": 60.0, "prompt_tokens": 128, "output_tokens": 128,
                     "batch": 16, "budget": 512}


def run_pressure(args: argparse.Namespace) -> int:
    import msgspec

    from loadgen.profiler.calibrate import calibrate, calibrate_batch
    from loadgen.profiler.kv_budget import kv_budget
    from loadgen.report.write import write_report
    from loadgen.runner.baseline import live_unloaded_baseline
    from loadgen.runner.runner import LoadRunner, RunnerConfig, served_context
    from loadgen.sim.profile import save_profile
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import PoissonParams
    from tidal.bench.fidelity_model import CONFIG, model_dir
    from tidal.bench.fidelity_cluster import HostShare, MultiWorkerCluster, StatsWatch
    from tidal.bench.fidelity_compare import Side, summary_line, table
    from shared.nats_server import free_port

    for name, value in PRESSURE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    context = args.prompt_tokens + args.output_tokens + 64
    budget_tokens = max(args.budget, args.batch)
    if args.mode == "vllm-0.6" and budget_tokens < context:
        raise SystemExit(f"tidal bench fidelity: --mode vllm-0.6 prefills whole prompts, so --budget ({budget_tokens}) "
                         f"must be at least the context length {context} (prompt + output + 64)")
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="tidal-bench-fidelity-")
    root = Path(tmp.name)
    model = model_dir(args, root)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    kv = kv_budget(Path(model), kv_tokens=args.kv_tokens, block_size=BLOCK, max_batch=args.batch,
                   max_batched_tokens=budget_tokens, max_model_len=context)
    profile, lines = _profile(args, Path(model), kv, context, budget_tokens)
    engine_profile = msgspec.structs.replace(profile, request_overhead_s=0.0)  # the engine alone: no serving path
    if args.request_overhead is not None:
        profile = msgspec.structs.replace(profile, request_overhead_s=args.request_overhead)
    print("\n".join(lines))
    print(f"KV budget: {kv.token_blocks} blocks of {BLOCK} tokens ({kv.token_blocks * BLOCK} tokens) per worker: "
          f"pool {kv.pool_bytes} B = {kv.fixed_bytes} B weights/workspace + {kv.layer_blocks} layer blocks of "
          f"{kv.block_bytes} B; engine mode {args.mode}, batch {args.batch}, token budget {budget_tokens}")
    trace = generate(PoissonParams(seed=args.seed, duration_s=args.duration, rate=args.rate, model="fidelity",
                                   prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens))
    print(f"trace: {len(trace.records)} requests over {args.duration:.0f} s (Poisson {args.rate}/s), "
          f"prompt {args.prompt_tokens}, output {args.output_tokens}; {args.workers} worker(s)")

    port = free_port()
    ids = [f"fid-{i}" for i in range(args.workers)]
    workers = "".join(f'[[workers]]\nid = "{w}"\ndevice = "cpu"\nmemory = {kv.pool_bytes}\nmodels = ["fidelity"]\n\n'
                      for w in ids)
    config = root / "cluster.toml"
    config.write_text(CONFIG.format(data=root / "data", port=port, model=model, context=context, workers=workers,
                                    batch=args.batch, budget=budget_tokens, block=BLOCK, mode=args.mode))
    url = f"http://127.0.0.1:{port}"
    cluster = MultiWorkerCluster(root, config, ids, threads=1)
    watch = StatsWatch()
    try:
        cluster.start(gateway_url=url)
        share = HostShare()
        ctx = served_context(url)
        runner_config = RunnerConfig(url=url, seed=args.seed)
        if not args.no_calibrate:
            n = args.calibration_requests
            alone = asyncio.run(live_unloaded_baseline(trace.records, runner_config, ctx, n))
            together = (asyncio.run(live_unloaded_baseline(trace.records, runner_config, ctx, n, parallel=args.workers))
                        if args.workers > 1 else None)
            profile, cal_lines = calibrate(profile, trace, alone, together)
            print("\n".join(cal_lines))
            k = args.calibration_batch
            if k > 1 and args.workers == 1:  # sequences decoding together: the per-sequence cost
                groups = asyncio.run(live_unloaded_baseline(trace.records, runner_config, ctx, n, parallel=k))
                profile, cal_lines = calibrate_batch(profile, trace, groups, n, k)
                print("\n".join(cal_lines))
        save_profile(out / "profile.json", profile)
        others_calibration = share.others()
        outcome = asyncio.run(watch.run(cluster.nats_url, args.workers,
                                        lambda: LoadRunner(trace.records, runner_config, context=ctx).run()))
        others_run = share.others()
    finally:
        cluster.stop()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    live_kv = {w.kv_blocks_total for w in watch.workers.values()}
    if live_kv != {kv.layer_blocks}:
        print(f"WARNING: the live workers report {sorted(live_kv)} KV blocks, not the {kv.layer_blocks} sized for")
    live = write_report(out / "live", outcome.records, title="fidelity under KV pressure: live",
                        extra={"load average": load, **outcome.overhead.as_extra()})
    sim_result, sim_peak = _simulate(trace, profile, args.workers)
    sim = write_report(out / "sim", sim_result.records, title="fidelity under KV pressure: simulated",
                       extra={"profile": str(out / "profile.json"), "engine mode": args.mode})
    failed = live.requests - live.completed
    print(f"load average after: {load}; live: {live.completed}/{live.requests} ok; "
          f"stats messages {watch.messages}")
    print("\n".join(outcome.overhead.lines()))
    live_side = Side(summary=live, preemptions=watch.preemptions,
                     kv_peak=max((w.kv_peak for w in watch.workers.values()), default=0.0))
    sim_side = Side(summary=sim, preemptions=sim_result.stats.preemptions, kv_peak=sim_peak)
    print("\n".join(table(live_side, sim_side)))
    if args.workers == 1:
        print(_replay_line(trace, profile, sim_side))
    if args.engine_run:
        print("\n".join(_engine_run_lines(Path(model), trace, engine_profile, kv, args, budget_tokens, context)))
    print(f"other processes on this host used {others_calibration:.2f} cores during the calibration, "
          f"{others_run:.2f} during the run (of {os.cpu_count()})")
    if max(others_calibration, others_run) > 0.25 * (os.cpu_count() or 1):  # nan (too short to tell): no
        print("WARNING: other processes took CPU from the live run (and the calibration), which the simulator "
              "cannot know; compare on a quiet host")
    if failed:
        print(f"{failed} live requests failed (reports: {out / 'live'})")
    print(summary_line(live_side, sim_side))
    tmp.cleanup()
    return 0 if failed == 0 else 1


def _profile(args: argparse.Namespace, model: Path, kv, context: int, budget: int):  # type: ignore[no-untyped-def]
    """This machine's profile of the model (loadgen/profiler), on the run's KV blocks, limits and engine mode."""
    import msgspec

    from loadgen.profiler.profile_engine import ProfileSettings, profile_engine

    settings = ProfileSettings(
        name="fidelity-pressure", threads=1, pool_bytes=int(kv.fixed_bytes + (64 << 20)), block_size=BLOCK,
        max_batch=args.batch, max_batched_tokens=budget, max_model_len=context,
        contexts=[32, args.prompt_tokens, context - 16], batches=[b for b in (1, 2, 4, 8, 16, 32) if b <= args.batch],
        links=False, prefill=[p for p in (8, 32, 64, 128, 256, 512) if p <= budget and p < context],
        passes=args.profile_passes, clock=args.profile_clock,
    )
    profile, lines = profile_engine(model, settings)
    worker = msgspec.structs.replace(profile.worker, kv_blocks=kv.token_blocks, engine_mode=args.mode,
                                     watermark=0.01 if args.mode == "vllm-0.6" else 0.0)  # vLLM's default
    return msgspec.structs.replace(profile, worker=worker), lines


def _replay_line(trace, profile, sim: Side) -> str:  # type: ignore[no-untyped-def]
    """The engine's own scheduler on the profile's step times (loadgen/profiler/scheduler_replay.py):
    where it agrees with the simulator, what is left between live and simulated is timing."""
    from loadgen.profiler.scheduler_replay import replay
    from loadgen.report.metrics import summarize_records
    from tidal.bench.fidelity_compare import error, latency

    rp = replay(trace, profile)
    s = summarize_records(rp.records)
    ttft = error(latency(s, "ttft", "p99"), latency(sim.summary, "ttft", "p99"))
    return (f"engine scheduler replayed on the profile's step times: {rp.preemptions} preemptions "
            f"(simulator {sim.preemptions}), P99 TTFT {latency(s, 'ttft', 'p99') * 1000:.1f} ms "
            f"(simulator differs by {ttft:.1%}), KV peak {rp.kv_peak:.0%}")


def _engine_run_lines(model: Path, trace, profile, kv, args, budget: int, context: int) -> list[str]:  # type: ignore[no-untyped-def]
    """--engine-run: the real engine in process on its CPU-second clock vs the simulator with the
    engine-only profile: the simulator's model of the engine, apart from the serving path and the host."""
    from loadgen.profiler.engine_replay import engine_replay
    from loadgen.report.metrics import summarize_records
    from tidal.bench.fidelity_compare import Side, table

    er = engine_replay(model, trace, pool_bytes=kv.pool_bytes, block_size=BLOCK, max_batch=args.batch,
                       max_batched_tokens=budget, max_model_len=context, policy=args.mode)
    sim, peak = _simulate(trace, profile, 1)
    rows = table(Side(summarize_records(er.records), er.preemptions, er.kv_peak),
                 Side(summarize_records(sim.records), sim.stats.preemptions, peak))
    return ["the engine in process on its CPU seconds (first column) vs the simulator, engine-only profile:",
            *rows[:4], rows[7]]


def _simulate(trace, profile, workers: int):  # type: ignore[no-untyped-def]
    """The simulated run and its KV peak (the fraction of blocks in use, over every worker)."""
    from loadgen.sim.simulator import Simulator
    from loadgen.sim.timeline import WorkerTimeline
    from shared.policy.routing_policies import make_policy

    sim = Simulator(trace, profile, workers, make_policy("least-load"))
    timelines = []
    for w in sim.workers:
        w.timeline = WorkerTimeline()
        timelines.append(w.timeline)
    result = sim.run()
    return result, max(t.kv_peak for t in timelines)


__all__ = ["PRESSURE_DEFAULTS", "run_pressure"]

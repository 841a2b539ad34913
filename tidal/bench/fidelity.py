"""`tidal bench fidelity`: the same small trace live (N CPU workers) and simulated (with a profile
fitted by `tidal profile` on the same model, on this machine); P50 TTFT and TPOT side by side.

Steps: generate (or take --model) a small llama checkpoint; fit its profile in process with
one torch thread (as each worker runs: `TIDAL_WORKER_THREADS=1`); write a Poisson trace with
fixed lengths; start nats + registry + dispatcher + N gpu_workers + gateway and run the
trace open loop (`loadgen/runner`); simulate the same trace on N workers with the profile.
The last line is the ratio simulated / live of P50 TTFT and TPOT (goal: each within 15%).
Both runs' reports are written under --out.

`--device cuda:0 --profile FILE` runs the engine on the device against the simulator on the profile
measured there (fidelity_device.py; `--device cpu` runs the same path on a CPU profile).

`--pressure` runs the check where KV runs out and the engine preempts (fidelity_pressure.py):
one worker with a KV budget of --kv-tokens, the live engine in scheduling policy --mode and the
simulator in the same engine mode; its own defaults (PRESSURE_DEFAULTS) for what is not given.

`--default-cluster` compares the running `tidal up` cluster with `tidal sim --scale-out` on its config
(fidelity_default.py): P99 TTFT within 20%.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from tidal.bench.fidelity_model import CONFIG, model_dir
from tidal.bench.output import add_out_argument, out_dir



# the light check's defaults; a --pressure run has its own (fidelity_pressure.PRESSURE_DEFAULTS)
LIGHT_DEFAULTS = {"workers": 2, "rate": 3.0, "duration": 60.0, "prompt_tokens": 128, "output_tokens": 32,
                  "batch": 32, "budget": 512}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="a small trace live and simulated: P50 TTFT/TPOT side by side "
                                        "(--pressure: where KV runs out, P99 TTFT and preemptions too)")
    p.add_argument("--default-cluster", action="store_true",
                   help="the running `tidal up` cluster against `tidal sim --scale-out` on its config, with a profile "
                        "measured here first: P50/P99 TTFT, TPOT (tidal/bench/fidelity_default.py)")
    p.add_argument("--trace", default=None, help="--default-cluster: the trace (default: Poisson 2 req/s for 20 s, "
                                                 "BurstGPT lengths, the config's first model)")
    p.add_argument("--profile", default=None, help="--default-cluster: a profile file instead of measuring one")
    p.add_argument("--colocated", type=int, default=None, metavar="N",
                   help="--default-cluster: measure the profile beside N-1 busy engines of the same settings (default: "
                        "the config's worker count, all on this box under `tidal up`; 1: alone)")
    p.add_argument("--state", default=None, metavar="DIR", help="--default-cluster: the cluster's data directory")
    p.add_argument("--model", help="checkpoint directory (default: generate a 4-layer llama, hidden 256)")
    p.add_argument("--pressure", action="store_true",
                   help="a KV budget small enough that the engine preempts: live vs simulated P50/P99 TTFT, "
                        "TPOT and preemption counts")
    p.add_argument("--mode", choices=("chunked", "vllm-0.6"), default="chunked",
                   help="--pressure: the live scheduling policy and the simulator's engine mode")
    p.add_argument("--kv-tokens", type=int, default=768, help="--pressure: KV per worker, in tokens (both sides)")
    p.add_argument("--calibration-batch", type=int, default=4, metavar="K",
                   help="--pressure: also send the calibration requests K at a time, for the live path's "
                        "per-sequence step cost (1: off)")
    p.add_argument("--profile-clock", choices=("cpu", "wall"), default="cpu",
                   help="--pressure: time the profile's steps in CPU seconds (the engine's own cost; calibration adds "
                        "the live path's, contention included) or wall seconds")
    p.add_argument("--engine-run", action="store_true",
                   help="--pressure: also run the trace through the engine in process on its CPU-second clock "
                        "and compare that with the simulator (minutes: the real steps run)")
    p.add_argument("--profile-passes", type=int, default=3,
                   help="--pressure: measure the profile this many times, keep each point's fastest (a shared host)")
    p.add_argument("--workers", type=int, default=None, help="default 2 (--pressure: 1)")
    p.add_argument("--rate", type=float, default=None, help="requests per second (default 3; --pressure: 2.5)")
    p.add_argument("--duration", type=float, default=None, help="seconds of trace (default 60)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="default 128")
    p.add_argument("--output-tokens", type=int, default=None, help="default 32 (--pressure: 128)")
    p.add_argument("--batch", type=int, default=None, help="max batch per worker, both sides (default 32; --pressure: 16)")
    p.add_argument("--budget", type=int, default=None, help="step token budget, both sides (default 512)")
    p.add_argument("--memory", default="512MiB", help="each worker's pool")
    p.add_argument("--request-overhead", type=float, default=None, metavar="S",
                   help="the profile's per-request overhead (gateway, dispatch, delivery; default 2 ms)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="simulate with the engine-only profile (no live per-step/per-request overhead added)")
    p.add_argument("--calibration-requests", type=int, default=12,
                   help="requests sent one at a time to measure the live path's overheads")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("--device: the engine on a device vs the simulator on its measured profile "
                             "(tidal/bench/fidelity_device.py)")
    g.add_argument("--device", default=None, help="cuda:N or cpu: the device mode (the default runs the CPU cluster check)")
    # its profile is --profile above (shared with --default-cluster): the device's measured one here
    g.add_argument("--requests", type=int, default=None, help="requests in the trace (default 200 on CUDA, 16 on a CPU)")
    add_out_argument(p, "fidelity")  # reports: <out>/live and <out>/sim, plus the profile
    p.set_defaults(func=run)


def _p50(summary, name: str) -> float:  # type: ignore[no-untyped-def]
    stats = getattr(summary, name)
    return stats.p50 if stats is not None else float("nan")


def run(args: argparse.Namespace) -> int:
    import msgspec

    from loadgen.profiler.profile_engine import ProfileSettings, profile_engine
    from loadgen.report.write import write_report
    from loadgen.profiler.calibrate import calibrate
    from loadgen.runner.baseline import live_unloaded_baseline
    from loadgen.runner.runner import LoadRunner, RunnerConfig, served_context
    from loadgen.sim.profile import save_profile
    from loadgen.sim.run import simulate
    from loadgen.traces.generate import generate
    from loadgen.traces.schema import PoissonParams
    from shared.config_units import ByteSize
    from tidal.bench.fidelity_cluster import MultiWorkerCluster
    from shared.nats_server import free_port

    if args.device is not None:
        from tidal.bench.fidelity_device import run_device

        return run_device(args)
    if args.default_cluster:
        from tidal.bench.fidelity_default import run_default

        return run_default(args)
    if not args.pressure and (args.mode != "chunked" or args.engine_run):
        raise SystemExit("tidal bench fidelity: --mode and --engine-run apply to --pressure runs only")
    if args.pressure:
        from tidal.bench.fidelity_pressure import run_pressure

        return run_pressure(args)
    for name, value in LIGHT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    out = out_dir(args, time.time())
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="tidal-bench-fidelity-")
    root = Path(tmp.name)
    model = model_dir(args, root)
    context = args.prompt_tokens + args.output_tokens + 64
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    settings = ProfileSettings(
        name="fidelity", threads=1, pool_bytes=int(ByteSize.parse(args.memory)), max_batch=args.batch,
        max_batched_tokens=args.budget, max_model_len=context, contexts=[32, args.prompt_tokens],
        batches=[b for b in (1, 2, 4, 8, 16, 32) if b <= args.batch], links=False,
        prefill=[p for p in (8, 32, 64, 128, 256, 512) if p <= args.budget],
    )
    profile, lines = profile_engine(Path(model), settings)
    if args.request_overhead is not None:
        profile = msgspec.structs.replace(profile, request_overhead_s=args.request_overhead)
    save_profile(out / "profile.json", profile)
    print("\n".join(lines))
    trace = generate(PoissonParams(seed=args.seed, duration_s=args.duration, rate=args.rate, model="fidelity",
                                   prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens))
    print(f"trace: {len(trace.records)} requests over {args.duration:.0f} s (Poisson {args.rate}/s), "
          f"prompt {args.prompt_tokens}, output {args.output_tokens}; {args.workers} workers")

    port = free_port()
    ids = [f"fid-{i}" for i in range(args.workers)]
    workers = "".join(f'[[workers]]\nid = "{w}"\ndevice = "cpu"\nmemory = "{args.memory}"\nmodels = ["fidelity"]\n\n'
                      for w in ids)
    config = root / "cluster.toml"
    config.write_text(CONFIG.format(data=root / "data", port=port, model=model, context=context, workers=workers,
                                    batch=args.batch, budget=max(args.budget, args.batch), block=16, mode="chunked"))
    url = f"http://127.0.0.1:{port}"
    cluster = MultiWorkerCluster(root, config, ids, threads=1)
    try:
        cluster.start(gateway_url=url)
        ctx = served_context(url)
        runner_config = RunnerConfig(url=url, seed=args.seed)
        if not args.no_calibrate:
            n = args.calibration_requests
            alone = asyncio.run(live_unloaded_baseline(trace.records, runner_config, ctx, n))
            together = asyncio.run(live_unloaded_baseline(trace.records, runner_config, ctx, n, parallel=args.workers))
            profile, cal_lines = calibrate(profile, trace, alone, together)
            print("\n".join(cal_lines))
            save_profile(out / "profile.json", profile)
        outcome = asyncio.run(LoadRunner(trace.records, runner_config, context=ctx).run())
    finally:
        cluster.stop()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    live = write_report(out / "live", outcome.records, title="fidelity: live",
                        extra={"load average": load, **outcome.overhead.as_extra()})
    sim_result = simulate(trace, profile, args.workers)
    sim = write_report(out / "sim", sim_result.records, title="fidelity: simulated", extra={"profile": str(out / "profile.json")})

    failed = live.requests - live.completed
    print(f"load average after: {load}; live: {live.completed}/{live.requests} ok")
    print("\n".join(outcome.overhead.lines()))
    print(f"{'metric':<10} {'live ms':>10} {'sim ms':>10} {'sim/live':>9}")
    ratios = {}
    for name in ("ttft", "tpot", "e2e"):
        a, b = _p50(live, name), _p50(sim, name)
        ratios[name] = b / a if a > 0 else float("nan")
        print(f"P50 {name.upper():<6} {a * 1000:>10.2f} {b * 1000:>10.2f} {ratios[name]:>9.2f}")
    ok = all(abs(ratios[n] - 1) <= 0.15 for n in ("ttft", "tpot"))
    print(f"fidelity: sim/live P50 TTFT {ratios['ttft']:.2f}, P50 TPOT {ratios['tpot']:.2f} "
          f"(goal 0.85-1.15: {'met' if ok else 'missed'}){f'; {failed} live requests failed' if failed else ''}")
    tmp.cleanup()
    return 0 if failed == 0 else 1


if __name__ == "__main__":  # `python -m tidal.bench.fidelity ...` without the other benches' imports (a GPU machine)
    import sys

    from tidal.bench.output import run_alone

    sys.exit(run_alone(register, "fidelity", sys.argv[1:]))

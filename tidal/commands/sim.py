"""`tidal sim TRACE --workers N [--policy least-load] [--profile FILE] --out DIR`.

Simulates the trace on N workers (discrete events, cost models from the profile) with the
same routing policy code as the live dispatcher, and writes the same report as a live run.
"""
from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    from shared.policy.routing_policies import POLICIES

    p = sub.add_parser("sim", help="simulate a trace on N workers and write the report")
    p.add_argument("trace", help="trace file (from `tidal trace`)")
    p.add_argument("--workers", type=int, required=True, help="simulated workers (one model instance each)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="least-load")
    p.add_argument("--profile", default=None,
                   help="cost profile: a .toml/.json file or a built-in name (cpu, a100-7b, h200-measured once "
                        "written); default cpu. A measured one (`tidal profile gpu`) puts its per-field sources "
                        "in the report")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--seed", type=int, default=0, help="seed for randomized policies")
    p.add_argument("--time-scale", type=float, default=1.0, help="divide the trace's arrival times by this")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="TTFT SLO in milliseconds")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="TPOT SLO in milliseconds")
    p.add_argument("--slo-e2e", type=float, default=None, metavar="MS", help="end-to-end SLO in milliseconds")
    p.add_argument("--slo-scale", type=float, default=None, metavar="K",
                   help="TTFT and TPOT SLOs = K x their unloaded P50 (KunServe uses 5)")
    p.add_argument("--kv-blocks", type=int, default=None, help="override the profile's KV blocks per worker")
    p.add_argument("--max-batch", type=int, default=None, help="override the profile's maximum batch")
    p.add_argument("--max-run-s", type=float, default=0.5,
                   help="longest decode run simulated as one event; bounds how stale routing views get")
    p.add_argument("--scale-out", action="store_true",
                   help="scale as the config does live: its min_instances per model serve from the start, the other "
                        "workers stand by, one more starts on measured saturation after the profile's instance start "
                        "(loadgen/sim/scale_out.py)")
    p.add_argument("--config", default=None, help="with --scale-out: the cluster TOML (default: the embedded default)")
    p.add_argument("--no-records", action="store_true", help="do not write records.jsonl")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from loadgen.report.markdown import render_markdown
    from loadgen.report.metrics import SloSpec
    from loadgen.sim.profile import load_profile
    from loadgen.sim.run import run_and_report
    from loadgen.traces.io import TraceFormatError, read_trace, scale_time
    from shared.config import ConfigError

    started = time.perf_counter()
    try:
        profile = load_profile(args.profile)
        worker = profile.worker
        if args.kv_blocks is not None:
            worker = msgspec.structs.replace(worker, kv_blocks=args.kv_blocks)
        if args.max_batch is not None:
            worker = msgspec.structs.replace(worker, max_batch=args.max_batch)
        profile = msgspec.structs.replace(profile, worker=worker)
        trace = read_trace(args.trace)
        if args.time_scale != 1.0:
            trace = scale_time(trace, args.time_scale)
        ms = {k: (None if v is None else v / 1000) for k, v in
              (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot), ("e2e_s", args.slo_e2e))}
        slo = SloSpec(**ms) if any(v is not None for v in ms.values()) else None
        scale_out = None
        if args.scale_out:
            from loadgen.sim.scale_out import spec_from_config
            from shared.config import load_config

            scale_out = spec_from_config(load_config(args.config), profile.start_s())
        result, summary = run_and_report(
            trace, profile, args.out, workers=args.workers, policy=args.policy, seed=args.seed, slo=slo,
            slo_scale=args.slo_scale, max_run_s=args.max_run_s, save_records=not args.no_records,
            plots=not args.no_plots, trace_name=args.trace, scale_out=scale_out)
    except (ValueError, TraceFormatError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_markdown(summary))
    from tidal.commands.profile_option import sim_sources

    for line in sim_sources(args.out, profile):
        print(line)
    print(f"simulated {result.stats.requests} requests on {args.workers} workers in {result.stats.wall_s:.2f} s "
          f"(whole command {time.perf_counter() - started:.2f} s); report in {args.out}")
    return 0

"""`tidal repro warmserve [--scale paper|tiny] [--out DIR]`: WarmServe §7.3 (Figs. 9, 11, 13-15) simulated.

Replays the real Azure LLM 2023 conversation and code hours (../shared/data/azure-llm-2023/,
CC-BY 4.0, Patel et al., ISCA 2024), every model its own 20-minute window, at rising RPS, uncompressed,
on every seed of `--seeds`, on WarmServe
(forecast -> replica counts -> prewarm scores -> evict-aware placement, proactive prewarming),
WarmServe without proactive prewarming, SLLM-GPU without and with an engine pool (all four run the
public code's autoscaler and pay the same start costs) and a MuxServe-like static co-location over
the paper's 16 GPUs; writes report.md, PNG figures and summary.json under --out and prints the
summary line last.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

HELP = "WarmServe (multi-LLM prewarming): P99 TTFT, starts by source, prewarm hit rate vs SLLM-GPU and MuxServe"

# `--live`: the small version on a local CPU cluster (loadgen/repro/warmserve_live.py): prewarm on vs off.


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.repro.warmserve import SCALES
    from loadgen.repro.warmserve_setup import WORKLOADS

    p.add_argument("--scale", choices=sorted(SCALES), default="paper",
                   help="paper: 3 workloads x RPS 5-25, the real hour each; tiny: one workload, 2 RPS, 10 minutes")
    p.add_argument("--out", default=None, help="report directory (default runs/repro-warmserve-<timestamp>/)")
    p.add_argument("--seed", type=int, default=None, help="the first workload seed (default 0)")
    p.add_argument("--seeds", type=int, default=None, metavar="N",
                   help="seeds per point: seed, seed+1, ... (default: the scale's, 5 at paper scale)")
    p.add_argument("--forecaster", choices=("ensemble", "csp"), default=None,
                   help="WarmServe's forecasts: the product's spike-guarded ensemble (default) or CSP alone")
    p.add_argument("--workloads", default=None, help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--rps", default=None, help="comma-separated request rates (default: the scale's)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNG figures")
    p.add_argument("--azure-dir", default=None, metavar="DIR",
                   help="directory of the Azure LLM 2023 CSVs (default ../shared/data/azure-llm-2023)")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="--live: seconds of the shifting trace (default 60)")
    p.add_argument("--runs", type=int, default=None, metavar="N",
                   help="--live: prewarm / no-prewarm pairs, each arm on a fresh cluster, the order alternating "
                        "(default 3); the ratio is printed as the median and range over them")
    p.add_argument("--live", action="store_true",
                   help="instead: a local cluster of 4 CPU workers and 5 small models under a shifting trace, "
                        "prewarm on vs off (P50/P99 TTFT, prewarm hit rate), then one model driven hard while "
                        "another idles (the autoscaler's scale-out time); a few minutes")


def _changes(args: argparse.Namespace) -> dict[str, object]:
    from loadgen.repro.warmserve_setup import WORKLOADS

    out: dict[str, object] = {}
    if args.seed is not None:
        out["seed"] = args.seed
    if getattr(args, "seeds", None) is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        out["seeds"] = args.seeds
    if getattr(args, "forecaster", None) is not None:
        out["forecaster"] = args.forecaster
    if args.workloads is not None:
        names = tuple(n.strip() for n in args.workloads.split(",") if n.strip())
        unknown = [n for n in names if n not in WORKLOADS]
        if unknown or not names:
            raise ValueError(f"unknown workload {unknown or args.workloads!r}; known: {', '.join(WORKLOADS)}")
        out["workloads"] = names
    if args.rps is not None:
        try:
            rates = tuple(float(r) for r in args.rps.split(",") if r.strip())
        except ValueError:
            raise ValueError(f"--rps must be comma-separated numbers, got {args.rps!r}") from None
        if not rates or min(rates) <= 0:
            raise ValueError(f"--rps needs at least one rate, each > 0, got {args.rps!r}")
        out["rps"] = rates
    if getattr(args, "azure_dir", None):
        out["azure_dir"] = args.azure_dir
    return out


def run(args: argparse.Namespace) -> int:
    from loadgen.repro.report import default_out
    from loadgen.repro.warmserve import SCALES, headline, run_repro
    from loadgen.repro.warmserve_report import write_warmserve_report

    if getattr(args, "live", False):
        return _run_live(args)
    started = time.perf_counter()
    try:
        cfg = dataclasses.replace(SCALES[args.scale], **_changes(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out("warmserve")
    try:
        points = run_repro(cfg, progress=lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError) as exc:  # no trace, or a replay longer than the trace
        print(f"error: {exc}", file=sys.stderr)
        return 2
    head = headline(points, cfg)
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "warmserve"] else []
    command = ("tidal repro warmserve " + shlex.join(argv)).strip()
    report = write_warmserve_report(out, points, cfg, head, command=command, wall_s=time.perf_counter() - started,
                                    plots=not args.no_plots)
    print(f"report: {report}")
    print(head.line())
    return 0


def _run_live(args: argparse.Namespace) -> int:
    from loadgen.repro.report import default_out
    from loadgen.repro.warmserve_live import WarmLiveConfig, run_live, write_summary

    if args.duration is not None and args.duration <= 0:
        print(f"error: --duration must be > 0 seconds, got {args.duration}", file=sys.stderr)
        return 2
    if args.runs is not None and args.runs < 1:
        print(f"error: --runs must be >= 1, got {args.runs}", file=sys.stderr)
        return 2
    cfg = WarmLiveConfig(seed=args.seed if args.seed is not None else 0)
    if args.runs is not None:
        cfg = dataclasses.replace(cfg, runs=args.runs)
    if args.duration is not None:
        cfg = dataclasses.replace(cfg, duration_s=args.duration)
    out = Path(args.out) if args.out else default_out("warmserve-live")
    run = run_live(cfg, root=out / "work", timelines=out,  # work/: models, cluster logs
                   progress=lambda line: print(line, flush=True))
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "warmserve"] else []
    print(f"summary: {write_summary(out, run, ('tidal repro warmserve ' + shlex.join(argv)).strip())}")
    print(run.line())
    lost = sum(r.lost for pair in run.pairs for r in pair.values())
    return 0 if lost == 0 else 1

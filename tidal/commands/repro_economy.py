"""`tidal repro economy [--scale paper|tiny] [--out DIR]`: the memory arbiter against each mechanism alone
and all four in the fixed order, at equal GPUs, on the mixed trace (simulated); `--live`: arbiter vs
fixed order on a small local CPU cluster.

Writes report.md, PNG figures (P99 TTFT and SLO attainment per arm, each GPU pool by kind over time,
purchases over time by source, the TTFT tail) and summary.json under --out; prints the summary line last.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import msgspec

HELP = "the memory economy: arbiter vs each mechanism alone vs the fixed order (P99 TTFT, SLO, GPUs, purchases)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.repro.economy_setup import SCALES

    p.add_argument("--scale", choices=sorted(SCALES), default="paper",
                   help="paper: 16 GPUs, the phased trace (3 x 10 min) at 15/20/25 req/s, 5 seeds; "
                        "tiny: 3 x 2 min, one rate, one seed")
    p.add_argument("--out", default=None, help="report directory (default runs/repro-economy-<timestamp>/)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the scale's)")
    p.add_argument("--rates", default=None, help="comma-separated request rates, req/s (default: the scale's)")
    p.add_argument("--arms", default=None, help="comma-separated subset of the arms (arbiter, fixed-order and "
                                                "unbounded are always run)")
    p.add_argument("--trace", choices=("phased", "mixed"), default=None,
                   help="phased (default): LoRA-heavy / KV burst / popularity shift from the Azure 2023 traces; "
                        "mixed: the older synthetic mixed trace")
    p.add_argument("--ablations", action="store_true",
                   help="also run the arbiter's ablations: each source left out, and its needs bought in the fixed "
                        "order (prices ignored)")
    p.add_argument("--no-gpu-sweep", action="store_true", help="skip the fewest-GPUs-to-SLO sweep")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run the points (one trace, every arm) over N processes (same figures; default 1)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNG figures")
    p.add_argument("--live", action="store_true",
                   help="instead: a local cluster of CPU workers, arbiter vs fixed order on a short mixed trace")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="--live: seconds of trace (default 60)")


def _numbers(text: str, what: str, kind: type) -> tuple:
    try:
        vals = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{what} must be comma-separated numbers, got {text!r}") from None
    if not vals or min(vals) < 0 or (kind is float and min(vals) <= 0):
        raise ValueError(f"--{what} needs at least one value, each > 0 (seeds >= 0), got {text!r}")
    return vals


def _config(args: argparse.Namespace):
    from loadgen.repro.economy_setup import SCALES
    from loadgen.sim.economy_result import ARMS

    cfg = SCALES[args.scale]
    changes: dict[str, object] = {}
    if args.seeds is not None:
        changes["seeds"] = _numbers(args.seeds, "seeds", int)
    if args.rates is not None:
        rates = _numbers(args.rates, "rates", float)
        changes["rates"] = rates
        if cfg.headline_rate not in rates:
            changes["headline_rate"] = rates[len(rates) // 2]
    if args.arms is not None:
        asked = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = [a for a in asked if a not in ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
        keep = set(asked) | {"arbiter", "fixed-order", "unbounded"}
        changes["arms"] = tuple(a for a in ARMS if a in keep)
    if args.no_gpu_sweep:
        changes["gpu_sweep"] = ()
    if args.trace is not None:
        changes["trace"] = args.trace
    if args.ablations:
        from loadgen.sim.economy_state import ABLATIONS

        changes["arms"] = (*changes.get("arms", cfg.arms), *ABLATIONS)
    return dataclasses.replace(cfg, **changes)


def run(args: argparse.Namespace) -> int:
    from loadgen.repro.economy import headline, run_repro
    from loadgen.repro.economy_report import write_economy_report
    from loadgen.repro.report import default_out

    if args.live:
        return _run_live(args)
    started = time.perf_counter()
    try:
        cfg = _config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out("economy")
    full: dict = {}
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    def checkpoint(point) -> None:  # each point as it ends (JSON), so a run cut short keeps what it had
        (out / "points").mkdir(parents=True, exist_ok=True)
        (out / "points" / f"rate{point.rate:g}-seed{point.seed}.json").write_bytes(msgspec.json.encode(point))

    points, gpus = run_repro(cfg, progress=lambda line: print(line, flush=True), keep=full, jobs=args.jobs,
                             checkpoint=checkpoint)
    head = headline(points, cfg, gpus)
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "economy"] else []
    command = ("tidal repro economy " + shlex.join(argv)).strip()
    report = write_economy_report(out, points, cfg, head, full, command=command,
                                  wall_s=time.perf_counter() - started, plots=not args.no_plots)
    print(f"report: {report}")
    print(head.line())
    return 0


def _run_live(args: argparse.Namespace) -> int:
    from loadgen.repro.economy_live import run_live_command

    return run_live_command(args)

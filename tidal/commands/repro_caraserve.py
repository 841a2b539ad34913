"""`tidal repro caraserve [--scale paper|tiny] [--out DIR] [--live]`: CaraServe §7.5 (Fig. 19).

Routes the MAF-derived adapter trace over 60 simulated servers with rank-aware (ours and strict
Alg. 1), MostIdle, Random and FirstFit under both LoRA kernels, then runs the cold-start experiment
(§7.2: one server, five modes, the paper's workloads), writes report.md, PNG figures and
summary.json under --out, and prints the summary line last. `--live` runs the small version on a local cluster beside the
simulator on the same trace (loadgen/repro/caraserve_live.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

HELP = ("CaraServe: rank-aware routing (TPOT SLO attainment, mean TPOT vs MostIdle/Random/FirstFit) and the cold "
        "start (TTFT overhead of CaraServe / OnDemand / S-LoRA vs Cached)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.repro.caraserve import POLICIES, SCALES

    p.add_argument("--scale", choices=sorted(SCALES), default="paper",
                   help="paper: 40,000 adapters, 340 RPS, 60 servers, 300 s simulated; tiny: a seconds-long smoke run")
    p.add_argument("--out", default=None, help="report directory (default runs/repro-caraserve-<timestamp>/)")
    p.add_argument("--seed", type=int, default=None, help="trace seed (default 0)")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="simulated seconds of trace")
    p.add_argument("--kernels", default=None, help="comma-separated subset of padded,segmented")
    p.add_argument("--policies", default=None, help=f"comma-separated subset of {','.join(POLICIES)} (rank-aware is required)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNG figures")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-start experiment (§7.2, one server)")
    live = p.add_argument_group("--live: the small version on a local cluster (real processes, CPU workers)")
    live.add_argument("--live", action="store_true", help="run it live, then the simulator on the same trace")
    live.add_argument("--profile", default=None, metavar="FILE",
                      help="with --live: the `tidal profile lora` file to route and simulate with (default: measured "
                           "at start); simulated: a measured device profile (tidal/commands/profile_option.py)")
    live.add_argument("--workers", type=int, default=2, help="CPU workers (default 2)")
    live.add_argument("--adapters", type=int, default=32, help="adapters, ranks 8/16/32/64 (default 32)")
    live.add_argument("--rate", type=float, default=3.0, help="requests per second (default 3)")


def _subset(text: str | None, known: tuple[str, ...], what: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or text!r}; known: {', '.join(known)}")
    return names


def run_live(args: argparse.Namespace) -> int:
    from loadgen.repro.caraserve_live_trace import POLICIES  # the dispatcher's (no strict Alg. 1 arm)
    from loadgen.repro.caraserve_live import run_live as live, write_live_report
    from loadgen.repro.caraserve_live_trace import LiveSpec, live_headline
    from loadgen.repro.report import default_out
    from shared.policy.lora_perf_model import KERNELS

    try:
        changes = {"seed": args.seed, "duration_s": args.duration, "policies": _subset(args.policies, POLICIES, "policy")}
        kernels = _subset(args.kernels, KERNELS, "kernel")
        if kernels:
            changes["kernel"] = kernels[0]
        spec = LiveSpec(workers=args.workers, adapters=args.adapters, rate=args.rate,
                        **{k: v for k, v in changes.items() if v is not None})
        profile = Path(args.profile) if args.profile else None
        if profile is not None and not profile.is_file():
            raise ValueError(f"--profile {profile}: no such file")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out("caraserve-live")
    result = live(spec, out, profile=profile, progress=lambda line: print(line, flush=True))
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "caraserve"] else ["--live"]
    report = write_live_report(out, result, ("tidal repro caraserve " + shlex.join(argv)).strip())
    print(f"report: {report}")
    print(live_headline(result.live, result.sim).line())
    return 0


def run(args: argparse.Namespace) -> int:
    from loadgen.repro.caraserve import POLICIES, SCALES, headline, run_repro

    if args.live:
        return run_live(args)
    from loadgen.repro.caraserve_report import write_caraserve_report
    from loadgen.repro.report import default_out
    from shared.policy.lora_perf_model import KERNELS

    started = time.perf_counter()
    try:
        changes = {"seed": args.seed, "duration_s": args.duration,
                   "kernels": _subset(args.kernels, KERNELS, "kernel"),
                   "policies": _subset(args.policies, POLICIES, "policy")}
        if args.no_cold:
            changes["cold_workloads"] = ()
        if args.duration is not None and args.duration <= 0:
            raise ValueError(f"--duration must be > 0, got {args.duration}")
        if changes["policies"] and "rank-aware" not in changes["policies"]:
            raise ValueError("--policies must include rank-aware (every figure is relative to it)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = dataclasses.replace(SCALES[args.scale], **{k: v for k, v in changes.items() if v is not None})
    out = Path(args.out) if args.out else default_out("caraserve")
    result = run_repro(cfg, progress=lambda line: print(line, flush=True))
    head = headline(result)
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "caraserve"] else []
    report = write_caraserve_report(out, result, head, command=("tidal repro caraserve " + shlex.join(argv)).strip(),
                                    wall_s=time.perf_counter() - started, plots=not args.no_plots)
    print(f"report: {report}")
    print(head.line())
    return 0

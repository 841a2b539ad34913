"""`tidal repro mell [--scale paper|tiny] [--out DIR]`: MELL §VIII (Figs. 11-15) simulated.

Builds the paper's workloads (Poisson, and the real Azure LLM 2023 conversation and code traces) on
its two testbeds, plays them on BF, WF, LB and MELL in the KV-packing fleet simulation (requests wait
when a GPU's engine preempts them; every move pays the movement costs), plus MELL without its
migration cap and the BF/WF arms that reserve the final size (hindsight), sweeps MELL's planning
interval, writes report.md, PNG figures and summary.json under --out, and prints the summary line
last (loadgen/repro/mell.py). `--live` runs a small version on a local cluster of CPU workers
instead, beside the planner off and the simulator on the same trace (loadgen/repro/mell_live.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from pathlib import Path

HELP = "MELL (multi-GPU KV packing): GPUs needed, utilisation, migrations vs BF/WF/LB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.repro.mell import SCALES
    from loadgen.repro.mell_setup import TESTBEDS, WORKLOADS

    p.add_argument("--scale", choices=sorted(SCALES), default="paper",
                   help="paper: an hour of each workload; reduced: a quarter hour of each; "
                   "tiny: 4 minutes of Poisson λ=1.1 s and Azure conv")
    p.add_argument("--out", default=None, help="report directory (default runs/repro-mell-<timestamp>/)")
    p.add_argument("--seed", type=int, default=None, help="workload seed (default 0)")
    p.add_argument("--testbeds", default=None, help=f"comma-separated subset of {','.join(TESTBEDS)}")
    p.add_argument("--workloads", default=None, help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--epoch", type=float, default=None, metavar="S", help="planning interval in seconds (default 1)")
    p.add_argument("--intervals", default=None, metavar="S,S,...",
                   help="other planning intervals MELL is swept over (default 0.5,2,5,10; empty: none)")
    p.add_argument("--sweep-workloads", default=None, help="workloads the interval sweep runs on "
                   "(default poisson-0.5)")
    p.add_argument("--azure-dir", default=None, help="folder of the Azure LLM inference trace 2023 CSVs "
                   "(default ../shared/data/azure-llm-2023)")
    p.add_argument("--azure-lengths", choices=("paper", "trace"), default=None,
                   help="Azure workloads' lengths: paper (§VIII-B's inputs, LMSYS-like x10; default) "
                   "or trace (its own)")
    p.add_argument("--core", action="store_true", help="also run MELL through the planner core (the live path)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="arms run in N processes at once (default: the CPUs, at most 4; same results)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNG figures")
    live = p.add_argument_group("--live: a small version on local clusters (4 CPU workers each; MELL and the planner "
                                "off at the same time), the simulator beside")
    live.add_argument("--live", action="store_true", help="run MELL live on a local cluster and compare with the simulator")
    live.add_argument("--duration", type=float, default=None, metavar="S", help="seconds of live trace (default 30)")
    live.add_argument("--rate", type=float, default=None, help="live requests per second per model (default 0.8)")
    live.add_argument("--memory", default=None, help="each live worker's pool (default 6MiB: tight KV)")


def _subset(text: str | None, known: dict, what: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown {what} {unknown or text!r}; known: {', '.join(known)}")
    return names


def _intervals(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--intervals: not a list of seconds: {text!r}") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"--intervals must be > 0, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    from loadgen.repro.mell import SCALES, headline
    from loadgen.repro.mell_runner import run_repro
    from loadgen.repro.mell_report import write_mell_report
    from loadgen.repro.mell_setup import TESTBEDS, WORKLOADS, AzureTraceMissing
    from loadgen.repro.report import default_out

    if args.live:
        return run_live_command(args)
    started = time.perf_counter()
    cfg = SCALES[args.scale]
    try:
        changes = {"seed": args.seed, "epoch_s": args.epoch,
                   "testbeds": _subset(args.testbeds, TESTBEDS, "testbed"),
                   "workloads": _subset(args.workloads, WORKLOADS, "workload"),
                   "sweep_epochs": _intervals(args.intervals),
                   "sweep_workloads": _subset(args.sweep_workloads, WORKLOADS, "workload"),
                   "azure_dir": args.azure_dir, "azure_lengths": args.azure_lengths, "core": args.core or None}
        if args.epoch is not None and args.epoch <= 0:
            raise ValueError(f"--epoch must be > 0, got {args.epoch}")
        jobs = args.jobs if args.jobs is not None else min(4, os.cpu_count() or 1)
        if jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {jobs}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if v is not None})
    out = Path(args.out) if args.out else default_out("mell")
    try:
        scenarios = run_repro(cfg, progress=lambda line: print(line, flush=True), jobs=jobs)
    except AzureTraceMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    head = headline(scenarios)
    command = "tidal repro mell " + shlex.join(sys.argv[3:]) if sys.argv[1:3] == ["repro", "mell"] else "tidal repro mell"
    report = write_mell_report(out, scenarios, cfg, head, command=command.strip(),
                               wall_s=time.perf_counter() - started, plots=not args.no_plots)
    print(f"report: {report}")
    print(head.line())
    return 0


def run_live_command(args: argparse.Namespace) -> int:
    from loadgen.repro.mell_live import LiveConfig, run_live
    from loadgen.repro.mell_live_report import comparison_table, live_headline, write_live_report
    from loadgen.repro.mell_live_trace import LiveTraceSpec
    from loadgen.repro.report import default_out

    try:
        trace = dataclasses.replace(LiveTraceSpec(), **{k: v for k, v in {
            "duration_s": args.duration, "rate_per_model": args.rate, "seed": args.seed}.items() if v is not None})
        cfg = LiveConfig(trace=trace, **({"memory": args.memory} if args.memory else {}),
                         **({"interval_s": args.epoch} if args.epoch is not None else {}))
        if cfg.interval_s <= 0:
            raise ValueError(f"--epoch must be > 0, got {cfg.interval_s}")
        from shared.config_units import ByteSize

        try:
            ByteSize.parse(cfg.memory)  # a bad size fails here, not in the workers' logs
        except ValueError as exc:
            raise ValueError(f"--memory: {exc}") from None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from shared.logging import configure_logging

    configure_logging("cli", level="warning")  # stdout is for the report
    out = Path(args.out) if args.out else default_out("mell-live")
    run = run_live(cfg, out / "live", progress=lambda line: print(line, flush=True))
    head = live_headline(run)
    command = "tidal repro mell " + shlex.join(sys.argv[3:]) if sys.argv[1:3] == ["repro", "mell"] else "tidal repro mell --live"
    report = write_live_report(out, run, head, command.strip())
    print(comparison_table(run))
    print(f"report: {report}")
    print(head.line())
    return 0 if head.lost == 0 else 1

"""`tidal repro kunserve [--scale paper|tiny] [--out DIR]`: KunServe §5 (Fig. 10, Fig. 16) simulated.

Runs KunServe and the Llumnix baselines over three datasets at rising scales (the harness's
upscaling) on 8 simulated Qwen-2.5-14B/A800 instances, plus the drop-plan ablation, writes report.md, PNG figures and
summary.json under --out, and prints the summary line last. `--live` runs a small version on a local
cluster instead: buddy groups on vs off on 4 CPU workers under a burst (loadgen/repro/kunserve_live.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

HELP = "KunServe (buddy groups under bursts): P50/P99 TTFT and TBT, SLO violations vs Llumnix variants"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from loadgen.repro.kunserve import SCALES

    p.add_argument("--scale", choices=sorted(SCALES), default="paper",
                   help="paper: 8 instances, 3 datasets x 3 scales x 3 seeds, 330 s each; tiny: 4 tight-memory instances, seconds")
    p.add_argument("--out", default=None, help="report directory (default runs/repro-kunserve-<timestamp>/)")
    p.add_argument("--seed", type=int, default=None, help="trace seed (with --live); simulated: run this one seed only")
    p.add_argument("--seeds", type=int, default=None, help="simulated: run seeds 0..N-1 (default 3 at paper scale)")
    p.add_argument("--burst-magnitude", type=float, default=None,
                   help="simulated: the spikes' rate multiplier (default 14, KunServe §2.2)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="simulated: a BurstGPT segment (`tidal trace burstgpt --csv CSV --kunserve-segment --out FILE`): "
                        "its 1-second bins replace the synthetic spikes, through the same upscaling")
    p.add_argument("--systems", default=None,
                   help="simulated: comma-separated subset of replication,migration,pipeline,kunserve")
    p.add_argument("--no-ablation", action="store_true", help="skip the Fig. 16 drop-plan ablation")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNG figures")
    live = p.add_argument_group("--live: the small version on a local cluster (real processes, CPU workers)")
    live.add_argument("--live", action="store_true", help="buddy groups vs `buddy_groups = false` under a burst, one run")
    live.add_argument("--workers", type=int, default=4, help="CPU workers, one instance each (default 4)")
    live.add_argument("--memory", default=None, help="each worker's pool (default 39MiB: weights are most of it)")


def run_live(args: argparse.Namespace) -> int:
    from loadgen.repro.kunserve_live import KunLiveConfig, run_live as live, write_summary
    from loadgen.repro.report import default_out
    from shared.config import ConfigError

    if args.workers < 2:
        print(f"error: --workers must be >= 2 (a buddy group pairs instances), got {args.workers}", file=sys.stderr)
        return 2
    cfg = KunLiveConfig(workers=args.workers)
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, trace=dataclasses.replace(cfg.trace, seed=args.seed))
    if args.memory is not None:
        cfg = dataclasses.replace(cfg, memory=args.memory)
    out = Path(args.out) if args.out else default_out("kunserve-live")
    try:
        result = live(cfg, out, progress=lambda line: print(line, flush=True))
    except ConfigError as exc:  # a bad setting, named (the config check before any process starts)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "kunserve"] else ["--live"]
    summary = write_summary(out, result, ("tidal repro kunserve " + shlex.join(argv)).strip())
    print(f"summary: {summary}")
    print(result.headline().line())
    return 0


def run(args: argparse.Namespace) -> int:
    from loadgen.repro.kunserve import SCALES, run_repro
    from loadgen.repro.kunserve_regime import headline
    from loadgen.repro.kunserve_report import write_kunserve_report
    from loadgen.repro.report import default_out

    if args.live:
        return run_live(args)
    started = time.perf_counter()
    cfg = SCALES[args.scale]
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seeds=(args.seed,))
    elif args.seeds is not None:
        if args.seeds < 1:
            print(f"error: --seeds must be >= 1, got {args.seeds}", file=sys.stderr)
            return 2
        cfg = dataclasses.replace(cfg, seeds=tuple(range(args.seeds)))
    if args.no_ablation:
        cfg = dataclasses.replace(cfg, ablation=False)
    if args.burst_magnitude is not None:
        if args.burst_magnitude < 1:
            print(f"error: --burst-magnitude must be >= 1, got {args.burst_magnitude}", file=sys.stderr)
            return 2
        cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, burst_magnitude=args.burst_magnitude))
    if args.trace is not None:
        from loadgen.repro.kunserve_workload import segment_bins
        from loadgen.traces.io import read_trace

        try:
            bins = segment_bins(read_trace(args.trace))
        except (OSError, ValueError) as exc:
            print(f"error: --trace {args.trace}: {exc}", file=sys.stderr)
            return 2
        cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, bins=bins))
    if args.systems is not None:
        from loadgen.sim.buddy_cluster import SYSTEMS

        systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
        bad = [s for s in systems if s not in SYSTEMS]
        if bad or not systems:
            print(f"error: --systems: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(SYSTEMS)}",
                  file=sys.stderr)
            return 2
        cfg = dataclasses.replace(cfg, systems=systems)
    out = Path(args.out) if args.out else default_out("kunserve")
    result = run_repro(cfg, progress=lambda line: print(line, flush=True))
    head = headline(result)
    argv = sys.argv[3:] if sys.argv[1:3] == ["repro", "kunserve"] else []
    report = write_kunserve_report(out, result, head, command=("tidal repro kunserve " + shlex.join(argv)).strip(),
                                   wall_s=time.perf_counter() - started, plots=not args.no_plots)
    print(f"report: {report}")
    print(head.line())
    return 0

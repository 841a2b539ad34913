"""`tidal repro prefix [--minutes M] [--seeds S,..] [--capacity B] [--out DIR]`: cached prefixes as a memory
source, simulated (loadgen/sim/prefix_economy.py): no caching, LRU release, and release by the memory
market's price (per instance, as the live arbiter; per prefix) on a shared-system-prompt + one-off-document
trace. Prints a table per seed and the headline of the first; with --out, writes report.md there.
"""
from __future__ import annotations

import argparse
from pathlib import Path

HELP = "cached prefixes as a memory source: released by price vs by recency (hit rate, TTFT), simulated"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="trace length (default 10)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--capacity", type=int, default=3000, help="the worker's KV blocks (default 3000)")
    p.add_argument("--cost-profile", default="a100-7b", help="simulator cost profile (default a100-7b)")
    p.add_argument("--out", default=None, help="write report.md here")


def run(args: argparse.Namespace) -> int:
    from loadgen.sim.prefix_economy import headline, run_arms, table
    from loadgen.sim.prefix_trace import PrefixTraceParams

    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"error: --seeds must be comma-separated integers, got {args.seeds!r}")
        return 2
    if not seeds or args.minutes <= 0 or args.capacity <= 0:
        print("error: --seeds needs one seed at least, --minutes and --capacity must be > 0")
        return 2
    lines: list[str] = []
    heads: list[str] = []
    for seed in seeds:
        results = run_arms(PrefixTraceParams(seed=seed, duration_s=args.minutes * 60), profile=args.cost_profile,
                           capacity_blocks=args.capacity)
        lines += [f"seed {seed}:", *table(results), ""]
        heads.append(headline(results))
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        body = ["# Cached prefixes as a memory source (simulated)", "",
                f"{args.minutes:g} minutes per seed, {args.capacity} KV blocks, cost profile {args.cost_profile}.", "",
                "```", *lines, *heads, "```", ""]
        (out / "report.md").write_text("\n".join(body))
        print(f"report: {out / 'report.md'}")
    print(heads[0])
    return 0

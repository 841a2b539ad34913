"""`tidal bench <what>`: benchmarks that print figures beside a baseline from the same run.

Each benchmark is a module `tidal.bench.<what>` exposing `register(subparsers)`.
Each prints its figures, the baseline's beside them, and the ratio on its last line.
"""
from __future__ import annotations

import argparse
import importlib

BENCHES: list[str] = ["bus", "engine", "sim", "gateway", "serve", "fidelity", "transfer", "migrate", "planner", "predictor", "lora", "lora_invoke", "kunserve_exchange", "prefix"]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark (prints figures, baseline beside them)")
    bench_sub = parser.add_subparsers(dest="bench", metavar="WHAT")
    for name in BENCHES:
        try:
            module = importlib.import_module(f"tidal.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"tidal.bench.{name}":
                continue
            raise
        module.register(bench_sub)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

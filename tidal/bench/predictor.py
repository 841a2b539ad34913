"""`tidal bench predictor`: the forecast ensemble and each of its members, on arrival rate and concurrency.

Members (shared/policy/forecast_members.py): WarmServe's CSP (Eqs. 2-4), last value, seasonal
naive, EWMA; the ensemble (shared/policy/forecast_ensemble.py) weighs them by their recent error
and reads P50/P90 from its own recent residuals. Scoring: tidal/bench/predictor_score.py.

Traces: two Azure-like weeks (loadgen/traces/azure.py's curves: AzureConv-like at `--rate`,
AzureCode-like at a third of it), an hour of `tidal trace mixed` (its defaults, `--seed`), the real Azure LLM 2023 CSVs found in `--azure-dir` (one hour
each; skipped with a note when the directory is absent), and every `--trace` file (the project's
JSONL, an Azure or BurstGPT CSV, or a CSV of timestamps with an optional model column). A trace
spanning two seasons or more is scored in `--window` windows from its second season on; a shorter
one in `--short-window` windows from window `--warmup` on, with no seasonal term.

Per trace: `bench predictor (NAME): ensemble_avg_err=N.N% ... guarded_avg_err=N.N% ... best_member=NAME`
(rate; guarded: the ensemble with the spike guard, shared/policy/forecast_guard.py) and
`bench predictor (NAME) concurrency: ...`; the last line averages the traces' rate figures (each
trace weighs the same; best_member_avg_err is the member best on that average):
`bench predictor: ensemble_avg_err=NN% ensemble_peak_err=NN% best_member_avg_err=NN% naive_avg_err=NN% p90_coverage=NN%`
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from shared.policy.forecast_ensemble import EnsembleParams
from shared.policy.forecast_members import MemberParams
from tidal.bench.output import add_out_argument, out_dir
from tidal.bench.predictor_score import ENSEMBLE, GUARDED, ScoreSetup, figures, score_trace, summary
from tidal.bench.predictor_series import ModelRequests, ServiceModel, azure_like, mixed_hour
from tidal.bench.predictor_traces import read_requests

AZURE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-2023"
AZURE_FILES = {"azure-2023-conv": "AzureLLMInferenceTrace_conv.csv", "azure-2023-code": "AzureLLMInferenceTrace_code.csv"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predictor", help="forecast ensemble vs its members (CSP, last value, seasonal naive, EWMA)")
    p.add_argument("--trace", action="append", default=[], help="also score this trace file (repeatable)")
    p.add_argument("--azure-dir", default=str(AZURE_DIR),
                   help="directory of the real Azure LLM 2023 CSVs (default ../shared/data/azure-llm-2023)")
    p.add_argument("--window", type=float, default=300.0, help="window length, seconds (paper: 300)")
    p.add_argument("--short-window", type=float, default=60.0, help="window of traces shorter than two seasons")
    p.add_argument("--warmup", type=int, default=10, help="history-only windows of a short trace")
    p.add_argument("--season", type=float, default=86_400.0, help="season length, seconds (a day)")
    p.add_argument("--slot", type=float, default=10.0, help="the peak is the busiest slot of this length")
    p.add_argument("--lookback", type=int, default=10, help="N of CSP's Eq. 3")
    p.add_argument("--days", type=float, default=7.0, help="length of the Azure-like traces, days")
    p.add_argument("--rate", type=float, default=8.0, help="mean requests/s of the AzureConv-like trace, all models")
    p.add_argument("--alpha", type=float, default=0.5, help="power-law exponent of the model shares")
    p.add_argument("--cv", type=float, default=1.0, help="burstiness of inter-arrival gaps (1 = Poisson)")
    p.add_argument("--prefill-tps", type=float, default=8_000.0, help="concurrency: prompt tokens/s of a server")
    p.add_argument("--tpot", type=float, default=0.025, help="concurrency: seconds per output token")
    p.add_argument("--request-time", type=float, default=2.0, help="concurrency: a request's time with no lengths")
    p.add_argument("--seed", type=int, default=1)
    add_out_argument(p, "bench-predictor")
    p.set_defaults(func=run)


def setup_for(duration_s: float, args: argparse.Namespace) -> ScoreSetup:
    seasonal = duration_s >= 2 * args.season
    window = args.window if seasonal else args.short_window
    per = args.season / window
    if seasonal and abs(per - round(per)) > 1e-9:
        raise SystemExit(f"error: --season ({args.season:g}s) must be a whole number of windows ({window:g}s)")
    s = round(per) if seasonal else int(duration_s // window) + 2  # no season within a short trace
    members = MemberParams(windows_per_season=s, lookback=args.lookback)
    return ScoreSetup(window_s=window, slot_s=min(args.slot, window), windows_per_season=s,
                      first=s if seasonal else args.warmup, members=members, ensemble=EnsembleParams(members),
                      service=ServiceModel(args.prefill_tps, args.tpot, args.request_time))


def _traces(args: argparse.Namespace) -> tuple[dict[str, tuple[dict[str, ModelRequests], float]], list[str]]:
    duration = args.days * 86_400.0
    traces = {
        "azureconv-like": (azure_like("conv", args.rate, args.days, args.alpha, args.cv, args.seed), duration),
        "azurecode-like": (azure_like("code", args.rate / 3, args.days, args.alpha, args.cv, args.seed + 1), duration),
        "mixed": mixed_hour(args.seed),
    }
    notes = []
    azure = Path(args.azure_dir)
    for name, file in AZURE_FILES.items():
        if (azure / file).is_file():
            traces[name] = read_requests(azure / file)
        else:
            notes.append(f"{name}: {azure / file} not found, skipped")
    for path in args.trace:
        traces[Path(path).name] = read_requests(path)
    return traces, notes


def report(name: str, result: dict) -> list[str]:
    methods = (*result["members"], ENSEMBLE, GUARDED)
    lines = [f"## {name}", "",
             f"{result['scored_windows']} windows of {result['window_s']:g} s scored per model (of "
             f"{result['windows']}; {'seasonal' if result['seasonal'] else 'no season in the trace'}). "
             f"P90 coverage: rate {result['p90_coverage']['rate']:.1f}%, concurrency "
             f"{result['p90_coverage']['conc']:.1f}%.", "",
             "| method | rate avg | rate peak | concurrency avg | concurrency peak |", "| --- | --- | --- | --- | --- |"]
    o = result["overall"]
    for m in methods:
        lines.append(f"| {m} | {o['rate'][m]['avg']:.2f}% | {o['rate'][m]['peak']:.2f}% | "
                     f"{o['conc'][m]['avg']:.2f}% | {o['conc'][m]['peak']:.2f}% |")
    lines += ["", "| model | requests | " + " | ".join(f"{m} rate avg" for m in methods) + " |",
              "| --- | --- | " + " | ".join("---" for _ in methods) + " |"]
    for model, r in result["models"].items():
        lines.append(f"| {model} | {r['requests']} | " + " | ".join(f"{r['rate'][m]['avg']:.2f}%" for m in methods)
                     + " |")
    return lines + [""]


def per_trace_table(results: dict[str, dict]) -> list[str]:
    """One row per trace: mean relative error of the ensemble, the guarded ensemble, last value, best member."""
    lines = ["## Per trace (mean relative error of the window's average)", "",
             "| trace | load | ensemble | ensemble+guard | last value | best member |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, result in results.items():
        for load in ("rate", "conc"):
            f = figures(result, load)
            lines.append(f"| {name} | {load} | {f['ensemble_avg_err']:.1f}% | {f['guarded_avg_err']:.1f}% | "
                         f"{f['naive_avg_err']:.1f}% | {f['best_member']} {f['best_member_avg_err']:.1f}% |")
    return lines + [""]


def _trace_line(fig: dict) -> str:
    keys = ("ensemble_avg_err", "ensemble_peak_err", "guarded_avg_err", "guarded_peak_err", "best_member_avg_err",
            "naive_avg_err", "p90_coverage")
    return " ".join(f"{k}={fig[k]:.1f}%" for k in keys) + f" best_member={fig['best_member']}"


def pooled(results: dict[str, dict]) -> dict[str, float | str]:
    """The traces' rate figures averaged, each trace weighing the same."""
    members = next(iter(results.values()))["members"]

    def avg(f) -> float:
        return float(np.mean([f(r) for r in results.values()]))
    per_member = {m: avg(lambda r, m=m: r["overall"]["rate"][m]["avg"]) for m in members}
    best = min(per_member, key=per_member.__getitem__)
    return {"ensemble_avg_err": avg(lambda r: r["overall"]["rate"][ENSEMBLE]["avg"]),
            "ensemble_peak_err": avg(lambda r: r["overall"]["rate"][ENSEMBLE]["peak"]),
            "guarded_avg_err": avg(lambda r: r["overall"]["rate"][GUARDED]["avg"]),
            "best_member_avg_err": per_member[best], "naive_avg_err": per_member["last_value"],
            "p90_coverage": avg(lambda r: r["p90_coverage"]["rate"]), "best_member": best}


def run(args: argparse.Namespace) -> int:
    started = time.time()
    out = out_dir(args, started)
    traces, notes = _traces(args)
    for note in notes:
        print(f"note: {note}", flush=True)
    results = {}
    for name, (per_model, span) in traces.items():
        results[name] = score_trace(per_model, span, setup_for(span, args))
        print(f"bench predictor ({name}): {_trace_line(figures(results[name], 'rate'))}", flush=True)
        print(f"bench predictor ({name}) concurrency: {_trace_line(figures(results[name], 'conc'))}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    keys = ("window", "short_window", "warmup", "season", "slot", "lookback", "days", "rate", "alpha", "cv",
            "prefill_tps", "tpot", "request_time", "seed")
    setup = {k: getattr(args, k) for k in keys}
    total = pooled(results)
    clean = json.loads(json.dumps(results, default=float), parse_constant=lambda c: None)
    (out / "results.json").write_text(json.dumps({"setup": setup, "notes": notes, "traces": clean,
                                                  "summary": total}, indent=2))
    text = ["# bench predictor", "", f"setup: {json.dumps(setup)}", "", *(f"note: {n}" for n in notes), ""]
    text += per_trace_table(results)
    for name, result in results.items():
        text += report(name, result)
    (out / "report.md").write_text("\n".join(text))
    print(f"wrote {out}/report.md and results.json ({time.time() - started:.1f} s)")
    if any(math.isnan(float(v)) for k, v in total.items() if k != "best_member"):
        print("warning: a figure is NaN (a trace with no scored load)")
    print(f"bench predictor: {summary(total)}")
    return 0

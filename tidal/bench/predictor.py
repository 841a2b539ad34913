"""`tidal bench predictor`: WarmServe's corrective seasonal predictor (CSP) against two baselines.

Each model's load per window -- average and peak rate, with the live predictor's definitions
(services/predictor/windows.py: peak = busiest `--slot` of the window) -- is forecast window by
window from all earlier windows, by CSP (Eqs. 2-4, shared/policy/warmserve_predictor.py) as the
text reads it (recent errors weigh most) and as Eq. 3 is printed, and by two baselines in the
same run: last value (the previous window) and seasonal naive (the same window one season ago).
Scored: mean relative error |forecast - actual| / actual over every model's windows from the
second season on (the first is history only, as the paper's Monday), windows with no load left
out. Paper (AzureConv, 5-minute windows): 5.25% average, 7.34% peak.

Traces: two Azure-like week-long loads from loadgen/traces/azure.py's rate curves and arrival
process (conv: `--rate`; code: a third of it, as AzureCode has fewer requests), and any trace
file given with `--trace` (the project's JSONL format, an Azure or BurstGPT CSV, or a CSV whose
first column is a timestamp -- seconds or date-time -- and optional second column a model).
The last line is the summary for the AzureConv-like trace:
`bench predictor: avg_err=N.N% peak_err=N.N% naive_avg_err=N.N% naive_peak_err=N.N%` (CSP; naive = last value),
then `seasonal_naive_avg_err=N.N% seasonal_naive_peak_err=N.N%`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from loadgen.traces.arrivals import arrivals
from loadgen.traces.azure import model_rate, power_law_shares
from loadgen.traces.schema import AzureParams
from services.predictor.windows import series_from_arrivals
from shared.policy.warmserve_predictor import (
    CspParams, last_value, predict_series, relative_errors, seasonal_naive,
)
from tidal.bench.output import add_out_argument, out_dir
from tidal.bench.predictor_traces import read_arrivals

METHODS = ("csp", "csp_printed_eq3", "last_value", "seasonal_naive")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predictor", help="CSP load forecasts vs last-value and seasonal-naive (mean relative error)")
    p.add_argument("--trace", action="append", default=[], help="also score this trace file (repeatable)")
    p.add_argument("--window", type=float, default=300.0, help="window length, seconds (paper: 300)")
    p.add_argument("--season", type=float, default=86_400.0, help="season length, seconds (a day)")
    p.add_argument("--slot", type=float, default=10.0, help="the peak is the busiest slot of this length")
    p.add_argument("--lookback", type=int, default=10, help="N of Eq. 3")
    p.add_argument("--days", type=float, default=7.0, help="length of the Azure-like traces, days")
    p.add_argument("--rate", type=float, default=8.0, help="mean requests/s of the AzureConv-like trace, all models")
    p.add_argument("--alpha", type=float, default=0.5, help="power-law exponent of the model shares")
    p.add_argument("--cv", type=float, default=1.0, help="burstiness of inter-arrival gaps (1 = Poisson)")
    p.add_argument("--seed", type=int, default=1)
    add_out_argument(p, "bench-predictor")
    p.set_defaults(func=run)


def azure_like(kind: str, rate: float, days: float, alpha: float, cv: float, seed: int) -> dict[str, np.ndarray]:
    """Arrival times per model, from the Azure-like generator's rate curves (no lengths drawn)."""
    params = AzureParams(seed=seed, duration_s=days * 86_400.0, rate=rate, alpha=alpha, kinds=[kind], cv=cv)  # type: ignore[list-item]
    rng = np.random.default_rng(seed)
    jitter = rng.uniform(-params.phase_jitter_h, params.phase_jitter_h, len(params.models))
    out = {}
    for i, share in enumerate(power_law_shares(len(params.models), alpha)):
        curve = model_rate(params, float(share), params.peak_hour + float(jitter[i]))
        out[params.models[i]] = arrivals(rng, curve, params.duration_s, dt=60.0, cv=cv)
    return out


def score(per_model: dict[str, np.ndarray], duration_s: float, args: argparse.Namespace) -> dict:
    csp = CspParams.for_windows(args.window, args.season, lookback=args.lookback)
    printed = CspParams.for_windows(args.window, args.season, lookback=args.lookback, weighting="printed")
    s = csp.windows_per_season
    windows = int(duration_s // args.window)
    if windows <= s:
        raise SystemExit(f"error: the trace covers {windows} windows; scoring needs more than one season ({s})")
    errors: dict[str, dict[str, list[float]]] = {m: {"avg": [], "peak": []} for m in METHODS}
    models = {}
    for model, times in sorted(per_model.items()):
        avg, peak = series_from_arrivals(times, args.window, args.slot, windows)
        for kind, series in (("avg", avg), ("peak", peak)):
            actual = series[s:]
            forecasts = {
                "csp": predict_series(series, csp)[s:],
                "csp_printed_eq3": predict_series(series, printed)[s:],
                "last_value": [last_value(series, w) for w in range(s, windows)],
                "seasonal_naive": [seasonal_naive(series, w, s) for w in range(s, windows)],
            }
            if kind == "peak":  # a forecast peak is never below the forecast average (as the service)
                avg_fc = {"csp": predict_series(avg, csp)[s:], "csp_printed_eq3": predict_series(avg, printed)[s:]}
                for m, values in avg_fc.items():
                    forecasts[m] = [max(a, b) for a, b in zip(forecasts[m], values)]
            for method, values in forecasts.items():
                errs = relative_errors(values, actual)
                errors[method][kind] += errs
                models.setdefault(model, {}).setdefault(method, {})[kind] = _mean(errs)
        models[model]["requests"] = int(len(times))
    overall = {m: {k: _mean(v) for k, v in kinds.items()} for m, kinds in errors.items()}
    return {"windows": windows, "scored_windows": windows - s, "overall": overall, "models": models}


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) * 100 if values else float("nan")


def report(name: str, result: dict) -> list[str]:
    o = result["overall"]
    lines = [f"## {name}", "", f"{result['scored_windows']} windows scored per model (of {result['windows']}).", "",
             "| method | avg load error | peak load error |", "| --- | --- | --- |"]
    lines += [f"| {m} | {o[m]['avg']:.2f}% | {o[m]['peak']:.2f}% |" for m in METHODS]
    lines += ["", "| model | requests | csp avg | csp peak | last value avg | seasonal naive avg |",
              "| --- | --- | --- | --- | --- | --- |"]
    for model, r in result["models"].items():
        lines.append(f"| {model} | {r['requests']} | {r['csp']['avg']:.2f}% | {r['csp']['peak']:.2f}% | "
                     f"{r['last_value']['avg']:.2f}% | {r['seasonal_naive']['avg']:.2f}% |")
    return lines + [""]


def summary(result: dict) -> str:
    o = result["overall"]
    # "naive" is the last-value forecast (the classic naive forecast); the seasonal-naive keys follow
    return (f"avg_err={o['csp']['avg']:.1f}% peak_err={o['csp']['peak']:.1f}% "
            f"naive_avg_err={o['last_value']['avg']:.1f}% naive_peak_err={o['last_value']['peak']:.1f}% "
            f"seasonal_naive_avg_err={o['seasonal_naive']['avg']:.1f}% "
            f"seasonal_naive_peak_err={o['seasonal_naive']['peak']:.1f}%")


def run(args: argparse.Namespace) -> int:
    started = time.time()
    out = out_dir(args, started)
    duration = args.days * 86_400.0
    traces: dict[str, tuple[dict[str, np.ndarray], float]] = {
        "azureconv-like": (azure_like("conv", args.rate, args.days, args.alpha, args.cv, args.seed), duration),
        "azurecode-like": (azure_like("code", args.rate / 3, args.days, args.alpha, args.cv, args.seed + 1), duration),
    }
    for path in args.trace:
        traces[Path(path).name] = read_arrivals(path)
    results = {}
    for name, (per_model, span) in traces.items():
        results[name] = score(per_model, span, args)
        print(f"bench predictor ({name}): {summary(results[name])}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    setup = {k: getattr(args, k) for k in ("window", "season", "slot", "lookback", "days", "rate", "alpha", "cv", "seed")}
    (out / "results.json").write_text(json.dumps({"setup": setup, "traces": results}, indent=2))
    text = ["# bench predictor", "", f"setup: {json.dumps(setup)}", "",
            "Paper (AzureConv, 5-minute windows): CSP 5.25% average, 7.34% peak.", ""]
    for name, result in results.items():
        text += report(name, result)
    (out / "report.md").write_text("\n".join(text))
    print(f"wrote {out}/report.md and results.json ({time.time() - started:.1f} s)")
    print(f"bench predictor: {summary(results['azureconv-like'])}")
    return 0

"""Scoring for `tidal bench predictor`: every ensemble member and the ensemble, window by window.

Each model's four series (tidal/bench/predictor_series.py: rate and concurrency, avg and peak)
are forecast window by window from all earlier windows by each member
(shared/policy/forecast_members.py) and by the ensemble (shared/policy/forecast_ensemble.py);
a peak forecast is never below the same method's avg forecast (as the live service publishes).
"ensemble+guard" is the ensemble with the spike guard (shared/policy/forecast_guard.py: toward the
last value when its last error jumps), as `tidal repro warmserve`'s planner reads it.
Scored: the mean relative error |forecast - actual| / actual over every model's windows from
`first` on (windows with no load left out), and the P90 coverage: the share of those windows
whose actual load is at most the ensemble's P90.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.policy.forecast_ensemble import EnsembleParams, ensemble_series
from shared.policy.forecast_guard import GuardParams, guard_series
from shared.policy.forecast_members import MemberParams, member_series
from shared.policy.warmserve_predictor import relative_errors
from tidal.bench.predictor_series import SERIES, ModelRequests, ServiceModel, load_series

ENSEMBLE = "ensemble"
GUARDED = "ensemble+guard"
KINDS = ("avg", "peak")


@dataclass(frozen=True)
class ScoreSetup:
    window_s: float
    slot_s: float
    windows_per_season: int  # more than the trace's windows: no season (a short trace)
    first: int  # the first window scored (the ones before are history only)
    members: MemberParams
    ensemble: EnsembleParams
    service: ServiceModel


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) * 100 if values else float("nan")


def _forecasts(series: dict[str, list[float]], setup: ScoreSetup, load: str, windows: int,
               ) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """method -> kind -> forecasts of windows 0..windows-1, and the ensemble's P90 of the avg."""
    out: dict[str, dict[str, list[float]]] = {}
    p90 = []
    for kind in KINDS:
        s = series[f"{load}_{kind}"]
        for name, values in member_series(s, setup.members, windows).items():
            out.setdefault(name, {})[kind] = values
        ens = ensemble_series(s, setup.ensemble, windows)
        out.setdefault(ENSEMBLE, {})[kind] = [e.point for e in ens]
        out.setdefault(GUARDED, {})[kind] = guard_series(s, [e.point for e in ens], GuardParams())
        if kind == "avg":
            p90 = [e.quantile(0.9) for e in ens]
    for method in out.values():  # a peak is never below the average
        method["peak"] = [max(p, a) for p, a in zip(method["peak"], method["avg"])]
    return out, p90


def score_trace(per_model: dict[str, ModelRequests], duration_s: float, setup: ScoreSetup) -> dict:
    windows = int(duration_s // setup.window_s)
    if windows <= setup.first:
        raise SystemExit(f"error: the trace covers {windows} windows of {setup.window_s:g} s; "
                         f"scoring starts at window {setup.first}")
    first = setup.first
    methods = (*setup.members.members, ENSEMBLE, GUARDED)
    errors = {load: {m: {k: [] for k in KINDS} for m in methods} for load in ("rate", "conc")}
    covered = {"rate": [], "conc": []}
    models: dict[str, dict] = {}
    for model, req in sorted(per_model.items()):
        series = load_series(req, setup.window_s, setup.slot_s, windows, setup.service)
        row: dict = {"requests": int(len(req.arrivals))}
        for load in ("rate", "conc"):
            fcs, p90 = _forecasts(series, setup, load, windows)
            actual_avg = series[f"{load}_avg"][first:]
            covered[load] += [a <= q + 1e-12 for a, q in zip(actual_avg, p90[first:]) if a > 0]
            for method, kinds in fcs.items():
                for kind in KINDS:
                    errs = relative_errors(kinds[kind][first:], series[f"{load}_{kind}"][first:])
                    errors[load][method][kind] += errs
                    row.setdefault(load, {}).setdefault(method, {})[kind] = _mean(errs)
        models[model] = row
    overall = {load: {m: {k: _mean(v) for k, v in kinds.items()} for m, kinds in per.items()}
               for load, per in errors.items()}
    coverage = {load: _mean([float(c) for c in cov]) for load, cov in covered.items()}
    return {"windows": windows, "scored_windows": windows - first, "window_s": setup.window_s,
            "seasonal": setup.windows_per_season < windows, "overall": overall, "p90_coverage": coverage,
            "models": models, "members": list(setup.members.members)}


def figures(result: dict, load: str = "rate") -> dict[str, float | str]:
    """The summary figures of one scored trace for one load (rate or conc)."""
    o = result["overall"][load]
    best = min(result["members"], key=lambda m: o[m]["avg"])
    return {"ensemble_avg_err": o[ENSEMBLE]["avg"], "ensemble_peak_err": o[ENSEMBLE]["peak"],
            "guarded_avg_err": o[GUARDED]["avg"], "guarded_peak_err": o[GUARDED]["peak"],
            "best_member_avg_err": o[best]["avg"], "naive_avg_err": o["last_value"]["avg"],
            "p90_coverage": result["p90_coverage"][load], "best_member": best}


def summary(fig: dict[str, float | str]) -> str:
    keys = ("ensemble_avg_err", "ensemble_peak_err", "best_member_avg_err", "naive_avg_err", "p90_coverage")
    return " ".join(f"{k}={fig[k]:.0f}%" for k in keys)


__all__ = ["ENSEMBLE", "GUARDED", "KINDS", "SERIES", "ScoreSetup", "figures", "score_trace", "summary"]

"""The load forecasts WarmServe's planner reads in `tidal repro warmserve`: one per model and window of the run.

A model's series is its concurrent load per window (avg and peak; requests in the system, each for the
public code's prefill_time + output x decode_time), first over the real trace before its replay window
(loadgen/repro/warmserve_setup.py: the history), then over the replay itself as its windows close. The
forecast of run window k reads only the windows before it. Two forecasters:

- "ensemble" (the default): the product's, as the live predictor runs it (shared/policy/forecast_ensemble.py:
  CSP, last value, seasonal naive, two EWMAs weighted by their recent errors), spike-guarded
  (shared/policy/forecast_guard.py: toward the last value when its last error jumps);
- "csp": WarmServe's corrective seasonal predictor alone (§5.1, Eqs. 2-4), as the paper's planner.

With one real hour per service there is no earlier day, so there is no seasonal term (Eq. 2's P is 0):
CSP is its corrective term, a recent-weighted mean of the last N = 10 windows; seasonal naive is the last
value. The paper's CSP had days of history (5.25% average error on AzureConv, §7.4); the report prints the
measured error beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.repro.warmserve_setup import (
    AZURE_DIR, Requests, Workload, load_hour, model_requests, model_starts, window_loads,
)
from loadgen.sim.fleet_profile import FleetModel, FleetProfile
from loadgen.traces.schema import Trace
from shared.policy.forecast_ensemble import EnsembleParams
from shared.policy.forecast_guard import GuardParams, guarded_ensemble_series
from shared.policy.forecast_members import MemberParams
from shared.policy.warmserve_predictor import CspParams, LoadForecast, predict_series

FORECASTERS = ("ensemble", "csp")


def _elapse(profile: FleetProfile, m: FleetModel, outputs: np.ndarray) -> np.ndarray:
    """Each request's time in the system as the public code characterises it."""
    return np.array([profile.request_s(m, 0, int(o)) for o in outputs]) if len(outputs) else np.zeros(0)


def _loads(profile: FleetProfile, parts: list[Requests], span_s: float, window_s: float
           ) -> dict[str, tuple[list[float], list[float]]]:
    return {m.name: window_loads(t, _elapse(profile, m, outputs), span_s, window_s)
            for m, (t, _prompts, outputs) in zip(profile.models, parts)}


@dataclass(frozen=True)
class Forecasts:
    per_model: dict[str, list[LoadForecast]]  # the forecast of each window of the run
    actual: dict[str, tuple[list[float], list[float]]]  # the run's own (avg, peak) per window
    history_windows: dict[str, int]  # windows of real history before each model's run
    forecaster: str = "ensemble"

    def error(self) -> tuple[float, float]:
        """The forecaster's mean relative error (avg, peak) over the windows and models with load (§7.4)."""
        errs: tuple[list[float], list[float]] = ([], [])
        for model, series in self.per_model.items():
            for k, f in enumerate(series):
                for j, (got, want) in enumerate(((f.avg, self.actual[model][0][k]), (f.peak, self.actual[model][1][k]))):
                    if want > 0:
                        errs[j].append(abs(got - want) / want)
        return (float(np.mean(errs[0])) if errs[0] else 0.0, float(np.mean(errs[1])) if errs[1] else 0.0)


def predict_run(series: list[float], first: int, forecaster: str) -> list[float]:
    """The forecasts of windows first..len(series)-1, each from the windows before it."""
    no_season = len(series) + 1  # one hour holds no earlier day
    if forecaster == "csp":
        return predict_series(series, CspParams(windows_per_season=no_season))[first:]
    if forecaster == "ensemble":
        params = EnsembleParams(MemberParams(windows_per_season=no_season))
        return guarded_ensemble_series(series, params, GuardParams(), len(series))[first:]
    raise ValueError(f"unknown forecaster {forecaster!r} (known: {', '.join(FORECASTERS)})")


def forecasts(profile: FleetProfile, w: Workload, trace: Trace, rps: float, window_s: float, seed: int,
              azure_dir: str = str(AZURE_DIR), history_s: float = 900.0, forecaster: str = "ensemble") -> Forecasts:
    """Per model, the forecast of each window of the run, from its real history and the run so far."""
    duration = trace.header.duration_s
    history_parts = model_requests(profile, w, rps, seed, duration, history_s, azure_dir, window_s=window_s)
    run = []
    for m in profile.models:
        recs = [r for r in trace.records if r.model == m.name]
        run.append((np.array([r.arrival_s for r in recs]), np.array([r.prompt_tokens for r in recs]),
                    np.array([r.output_tokens for r in recs])))
    actual = _loads(profile, run, duration, window_s)
    starts = model_starts(load_hour(w.kind, azure_dir), len(profile.models), duration, history_s)
    out: dict[str, list[LoadForecast]] = {}
    windows: dict[str, int] = {}
    for m, hist, start in zip(profile.models, history_parts, starts):
        n = int(start // window_s)  # whole windows of real history before the replay
        h_avg, h_peak = window_loads(hist[0], _elapse(profile, m, hist[2]), n * window_s, window_s) if n else ([], [])
        avg, peak = actual[m.name]
        f_avg = predict_run(h_avg + avg, n, forecaster)
        f_peak = predict_run(h_peak + peak, n, forecaster)
        out[m.name] = [LoadForecast(avg=a, peak=max(a, p)) for a, p in zip(f_avg, f_peak)]
        windows[m.name] = n
    return Forecasts(out, actual, windows, forecaster)

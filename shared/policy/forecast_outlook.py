"""A model's load outlook for the next window (pure): the ensemble's forecasts of its average and
peak, and the chance that the load exceeds a level (what an arbiter prices a replica with).

Two loads are forecast alike: the arrival rate (requests/s) and the concurrency (requests in the
system: running and waiting; WarmServe's load). Each has an average and a peak series; the peak
forecast (point and every quantile) is never below the average's, as a window's peak is at
least its mean.

`chance_above(p50, p90, level)` reads the two published quantiles as a normal distribution
(median p50, sigma = (p90 - p50) / z_0.9) and returns P(load > level): two numbers on the wire
are enough for a consumer to price "this replica is needed" without the residuals themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shared.policy.forecast_ensemble import EnsembleForecast, EnsembleParams, ensemble_at
from shared.policy.warmserve_predictor import Series

Z90 = 1.2815515655446004  # the standard normal's 0.9 quantile


@dataclass(frozen=True)
class LoadOutlook:
    avg: EnsembleForecast
    peak: EnsembleForecast  # point and quantiles >= avg's


def at_least(peak: EnsembleForecast, avg: EnsembleForecast) -> EnsembleForecast:
    """`peak` raised to `avg` wherever it is below (point and each quantile)."""
    qs = tuple((q, max(v, a)) for (q, v), (_, a) in zip(peak.quantiles, avg.quantiles))
    return replace(peak, point=max(peak.point, avg.point), quantiles=qs)


def outlook(avg_series: Series, peak_series: Series, w: int, p: EnsembleParams) -> LoadOutlook:
    """The ensemble's forecasts of window w's average and peak (w may be len(series): the next window)."""
    avg = ensemble_at(avg_series, w, p)
    return LoadOutlook(avg=avg, peak=at_least(ensemble_at(peak_series, w, p), avg))


def chance_above(p50: float, p90: float, level: float) -> float:
    """P(load > level) for a load whose median is p50 and 0.9 quantile p90 (a normal through both)."""
    if p90 < p50:
        raise ValueError(f"p90 ({p90}) must be >= p50 ({p50})")
    if p90 == p50:
        return 1.0 if level < p50 else 0.0
    z = (level - p50) / ((p90 - p50) / Z90)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


__all__ = ["LoadOutlook", "Z90", "at_least", "chance_above", "outlook"]

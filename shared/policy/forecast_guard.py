"""A spike guard for a load forecaster (pure): fall back toward the last value when its recent error jumps.

The ensemble (shared/policy/forecast_ensemble.py) weighs its members by their errors over many windows,
so after a spike or a level shift it keeps leaning on members that average the past for several windows,
while the last value follows at once. On real series (issue 30: public counts, 12 series) that cost it 8-82
points of hourly-mean error against last value. The guard reads the forecaster's own error on the last
observed window u = w - 1, with a = the load of u and f the forecaster's forecast of it:

    e  = |f_u - a| / a                      (the forecaster's error on u; u without load: no guard)
    e0 = median of its errors on the `baseline_windows` windows before u with load (none: 0)
    lam = 0                                 if e < min_error, or e <= the last value's error on u
        = clamp((e / e0 - 1) / (jump - 1), 0, 1) otherwise (e0 = 0: 1)
    guarded_w = lam x last_value_w + (1 - lam) x f_w

So an error `jump` times its usual one, above `min_error` and worse than the last value did on the same
window, moves the forecast all the way to the last value; an error at its usual level leaves it alone.
At the first window of a shift (or of a one-window spike) the last value missed about as badly, so
little moves: a spike is not carried. From the next window the last value carries a new level, and the
ensemble, still lagging, is pulled to it; after a spike the ensemble, still inflated by it, is pulled
back. The errors read are the unguarded forecaster's (it lags a shift for several windows, so the guard
holds while it does), and only windows before w: the guarded forecast of w is as causal as the
forecaster's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from shared.policy.forecast_ensemble import EnsembleForecast, EnsembleParams, ensemble_range, ensemble_series
from shared.policy.warmserve_predictor import Series, last_value


@dataclass(frozen=True)
class GuardParams:
    baseline_windows: int = 12  # earlier windows whose median error is the forecaster's usual one
    jump: float = 2.0  # the last error this many times the usual one: all the way to the last value
    min_error: float = 0.2  # a relative error below this is never a spike

    def __post_init__(self) -> None:
        if self.baseline_windows < 1:
            raise ValueError(f"baseline_windows must be >= 1, got {self.baseline_windows}")
        if not self.jump > 1:
            raise ValueError(f"jump must be > 1, got {self.jump}")
        if not self.min_error >= 0:
            raise ValueError(f"min_error must be >= 0, got {self.min_error}")


def _error(series: Series, forecasts: Sequence[float], u: int) -> float | None:
    a = series[u] if 0 <= u < len(series) and u < len(forecasts) else None
    if a is None or a <= 0:
        return None
    return abs(forecasts[u] - a) / a


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def spike_weight(series: Series, forecasts: Sequence[float], w: int, p: GuardParams) -> float:
    """lam for window w: how far its forecast moves toward the last value (0: not at all, 1: all the way)."""
    u = w - 1
    e = _error(series, forecasts, u)
    if e is None or e < p.min_error:
        return 0.0
    a = series[u]
    assert a is not None
    if e <= abs(last_value(series, u) - a) / a:
        return 0.0  # the last value missed u as badly: a new level it carries is not shown yet
    earlier = [x for v in range(max(0, u - p.baseline_windows), u) if (x := _error(series, forecasts, v)) is not None]
    usual = _median(earlier) if earlier else 0.0
    if usual <= 0:
        return 1.0
    return min(1.0, max(0.0, (e / usual - 1.0) / (p.jump - 1.0)))


def guard_series(series: Series, forecasts: Sequence[float], p: GuardParams) -> list[float]:
    """Every forecast of `forecasts` (window w's, from windows < w) guarded; same length."""
    out = []
    for w, f in enumerate(forecasts):
        lam = spike_weight(series, forecasts, w, p)
        out.append(f if lam == 0 else lam * last_value(series, w) + (1.0 - lam) * f)
    return out


def guarded_ensemble_series(series: Series, ensemble: EnsembleParams, p: GuardParams, end: int | None = None
                            ) -> list[float]:
    """The ensemble's point forecast of every window 0..end-1 (default: one past the data), spike-guarded."""
    points = [e.point for e in ensemble_series(series, ensemble, end)]
    return guard_series(series, points, p)


def guarded_at(series: Series, w: int, ensemble: EnsembleParams, p: GuardParams) -> tuple[EnsembleForecast, float]:
    """The ensemble's forecast of window w (w may be len(series): the next window), spike-guarded, and its
    lam: the point as `guarded_ensemble_series` gives it for w (what the simulator reads), computed from
    the ensemble's forecasts of w and the `baseline_windows` + 1 windows before it only (the live
    predictor's cost: one pass, not one per window). Each quantile moves with the point (by the same
    amount, never below 0): the guard moves the level, not the spread of the ensemble's residuals."""
    first = max(0, w - 1 - p.baseline_windows)
    fcs = ensemble_range(series, first, w + 1, ensemble)
    points = [0.0] * first + [f.point for f in fcs]  # only windows first..w are read
    lam = spike_weight(series, points, w, p)
    raw = fcs[-1]
    if lam == 0:
        return raw, 0.0
    point = lam * last_value(series, w) + (1.0 - lam) * raw.point
    delta = point - raw.point
    return replace(raw, point=point, quantiles=tuple((q, max(0.0, v + delta)) for q, v in raw.quantiles)), lam


__all__ = ["GuardParams", "guard_series", "guarded_at", "guarded_ensemble_series", "spike_weight"]

"""An online ensemble of load forecasters, weighted by each member's recent error, with quantiles (pure).

For window w, every member (shared/policy/forecast_members.py) forecasts the load; the ensemble's
point forecast is their weighted mean. A member's weight is the inverse of its recent mean
squared relative error,

    score_i(w) = sum_k g^k e_i(w-1-k)^2 / sum_k g^k,   k < error_windows, e = (f - a) / a, a > 0
    weight_i(w) = (1 / score_i) / sum_j (1 / score_j)

(Bates and Granger's inverse-MSE combination, discounted by g = `error_discount` so that a member
that turns good or bad is followed within a few windows; the relative error makes a busy and an
idle model alike, as the bench scores them). Windows with no load or not observed carry no error;
before any error every member weighs the same. A member with no error at all takes every weight.

Quantiles come from the ensemble's own recent residuals, relative to its point forecast:
r = (a - f) / max(f, floor) over the last `residual_windows` observed windows, floor =
`floor_fraction` x the mean recent load (so an idle model's residuals do not divide by 0), and
quantile q of window w = max(0, f + max(f, floor) x Q_q(r)) (linear interpolation between order
statistics). With no residual yet, every quantile is the point forecast.

Every forecast of window w depends only on the windows [w - lookback_windows(p), w) and on what
members need, so `ensemble_at` (one window, for the live predictor) equals `ensemble_series`
(every window, for benches).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.policy.forecast_members import MemberParams, member_forecast, member_series
from shared.policy.warmserve_predictor import Series


@dataclass(frozen=True)
class EnsembleParams:
    members: MemberParams
    error_windows: int = 12  # recent windows whose errors weigh the members
    error_discount: float = 0.85  # g: an error k windows older weighs g^k
    residual_windows: int = 96  # recent residuals the quantiles are read from
    floor_fraction: float = 0.1
    quantiles: tuple[float, ...] = (0.5, 0.9)

    def __post_init__(self) -> None:
        if self.error_windows < 1 or self.residual_windows < 1:
            raise ValueError(f"error_windows and residual_windows must be >= 1, got "
                             f"{self.error_windows} and {self.residual_windows}")
        if not 0 < self.error_discount <= 1:
            raise ValueError(f"error_discount must be in (0, 1], got {self.error_discount}")
        if not self.floor_fraction > 0:
            raise ValueError(f"floor_fraction must be > 0, got {self.floor_fraction}")
        if not self.quantiles or any(not 0 < q < 1 for q in self.quantiles) or list(self.quantiles) != sorted(
                set(self.quantiles)):
            raise ValueError(f"quantiles must be distinct, ascending and in (0, 1), got {self.quantiles}")


@dataclass(frozen=True)
class MemberForecast:
    name: str
    forecast: float
    weight: float  # in [0, 1]; the members' weights sum to 1
    recent_error: float | None  # sqrt of the discounted mean squared relative error; None: no error yet


@dataclass(frozen=True)
class EnsembleForecast:
    point: float  # the weighted mean of the members' forecasts
    quantiles: tuple[tuple[float, float], ...]  # (q, load) ascending in q, loads non-decreasing
    members: tuple[MemberForecast, ...]

    def quantile(self, q: float) -> float:
        for level, value in self.quantiles:
            if abs(level - q) < 1e-12:
                return value
        raise KeyError(f"quantile {q} was not computed (have {[lv for lv, _ in self.quantiles]})")


def lookback_windows(p: EnsembleParams) -> int:
    """Windows before w whose member forecasts the ensemble's forecast of w reads."""
    return p.residual_windows + 2 * p.error_windows


def _observed(series: Series, v: int) -> float | None:
    return series[v] if 0 <= v < len(series) else None


def _weights(series: Series, fcs: dict[str, list[float]], v: int, origin: int,
             p: EnsembleParams) -> tuple[list[float], list[float | None]]:
    """Members' weights for window v (fcs[name][v - origin] is member name's forecast of v)."""
    names = p.members.members
    sums = [0.0] * len(names)
    used = 0.0
    for k in range(min(p.error_windows, v - origin)):
        u = v - 1 - k
        a = _observed(series, u)
        if a is None or a <= 0:
            continue
        g = p.error_discount ** k
        used += g
        for i, name in enumerate(names):
            e = (fcs[name][u - origin] - a) / a
            sums[i] += g * e * e
    if not used:
        return [1.0 / len(names)] * len(names), [None] * len(names)
    scores = [s / used for s in sums]
    perfect = [i for i, s in enumerate(scores) if s == 0.0]
    if perfect:
        weights = [1.0 / len(perfect) if i in perfect else 0.0 for i in range(len(names))]
    else:
        inv = [1.0 / s for s in scores]
        weights = [x / sum(inv) for x in inv]
    return weights, [s ** 0.5 for s in scores]


def empirical_quantile(values: Sequence[float], q: float) -> float:
    """Quantile q of `values` by linear interpolation between order statistics."""
    if not values:
        raise ValueError("no values to take a quantile of")
    s = sorted(values)
    x = q * (len(s) - 1)
    lo = int(x)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (x - lo)


def _floor(series: Series, v: int, p: EnsembleParams) -> float:
    seen = [a for u in range(v - p.error_windows, v) if (a := _observed(series, u)) is not None]
    mean = sum(seen) / len(seen) if seen else 0.0
    return max(p.floor_fraction * mean, 1e-12)


def _run(series: Series, fcs: dict[str, list[float]], origin: int, first: int, end: int,
         p: EnsembleParams) -> list[EnsembleForecast]:
    """The ensemble's forecasts of windows first..end-1, member forecasts given from `origin`."""
    names = p.members.members
    points: dict[int, float] = {}
    residuals: dict[int, float] = {}
    out = []
    start = max(origin, first - p.residual_windows)
    for v in range(start, end):
        weights, errors = _weights(series, fcs, v, origin, p)
        point = sum(w * fcs[n][v - origin] for w, n in zip(weights, names))
        points[v] = point
        scale = max(point, _floor(series, v, p))
        if v >= first:
            recent = [residuals[u] for u in range(v - p.residual_windows, v) if u in residuals]
            qs = tuple((q, max(0.0, point + scale * empirical_quantile(recent, q)) if recent else point)
                       for q in p.quantiles)
            members = tuple(MemberForecast(n, fcs[n][v - origin], w, e) for n, w, e in zip(names, weights, errors))
            out.append(EnsembleForecast(point=point, quantiles=qs, members=members))
        a = _observed(series, v)
        if a is not None:
            residuals[v] = (a - point) / scale
    return out


def ensemble_series(series: Series, p: EnsembleParams, end: int | None = None) -> list[EnsembleForecast]:
    """The ensemble's forecast of every window 0..end-1 (default: one past the data), each from the windows before it."""
    end = len(series) + 1 if end is None else end
    return _run(series, member_series(series, p.members, end), 0, 0, end, p)


def ensemble_at(series: Series, w: int, p: EnsembleParams) -> EnsembleForecast:
    """The ensemble's forecast of window w (w may be len(series): the next window)."""
    origin = max(0, w - lookback_windows(p))
    fcs = {n: [member_forecast(n, series, v, p.members) for v in range(origin, w + 1)] for n in p.members.members}
    return _run(series, fcs, origin, w, w + 1, p)[0]


__all__ = [
    "EnsembleForecast", "EnsembleParams", "MemberForecast", "empirical_quantile", "ensemble_at", "ensemble_series",
    "lookback_windows",
]

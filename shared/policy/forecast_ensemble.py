"""An online ensemble of load forecasters, weighted by each member's recent error, with quantiles (pure).

For window w, every member (shared/policy/forecast_members.py) forecasts the load; the ensemble's
point forecast is their weighted mean, with weights from their recent relative errors
e = (f - a) / a on the windows before w (shared/policy/forecast_combination.py):

    M_ij(w) = sum_k g^k e_i(w-1-k) e_j(w-1-k) / sum_k g^k,   k < error_windows, windows with a > 0
    duplicates out: a member with the same errors and forecast as an earlier one weighs 0
    C = M with its off-diagonal shrunk by (1 - shrinkage)
    w_mv = argmin w'Cw over w >= 0, sum w = 1  (C x = 1 on the members kept, those with x <= 0 dropped)
    weights = psi w_mv + (1 - psi) (all on the member of least M_ii),  psi = max(0, 1 - k / n_eff)

with k the distinct members and n_eff = (sum g^k)^2 / sum g^2k the errors' effective number of
windows: the min-variance weights are estimated from few windows, and while they are noisy (k
close to n_eff) the ensemble leans on its recently best member instead of a hedge it cannot yet
tell from noise. Each error is clamped to +-`error_cap` (100%): a burst that every member misses by
700% would otherwise rule the weights for `error_windows` windows. With shrinkage 1 the min-variance
step is the inverse-MSE combination; below 1 it sees that members whose errors move together (last
value and CSP share the last window's noise) add little to each other. The discount g =
`error_discount` follows a member that turns good or bad; relative errors make a busy and an idle
model alike, as the bench scores them. Windows with no load or not observed carry no error; before
any error every member weighs the same; a member with no error takes every weight. Defaults were
chosen on synthetic traces (the Azure-like weeks, the mixed hour), never on the real ones
(docs/benchmarks.md#predictor).

Quantiles come from the ensemble's own recent residuals, relative to its point forecast:
r = (a - f) / max(f, floor), clamped to +-`residual_cap`, over the last `residual_windows` observed
windows, floor = `floor_fraction` x the mean recent load (so an idle model's residuals do not divide
by 0), and quantile q of window w = max(0, f + max(f, floor) x Q_q(r)) (linear interpolation between order
statistics). With no residual yet, every quantile is the point forecast.

Every forecast of window w depends only on the windows [w - lookback_windows(p), w) and on what
members need, so `ensemble_at` (one window, for the live predictor) equals `ensemble_series`
(every window, for benches).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.policy.forecast_combination import combination_weights
from shared.policy.forecast_members import MemberParams, member_forecast, member_series
from shared.policy.warmserve_predictor import Series


@dataclass(frozen=True)
class EnsembleParams:
    members: MemberParams
    error_windows: int = 48  # recent windows whose errors weigh the members
    error_discount: float = 0.95  # g: an error k windows older weighs g^k
    residual_windows: int = 96  # recent residuals the quantiles are read from
    floor_fraction: float = 0.1
    error_cap: float = 1.0  # |relative error| counted at most this (a burst's 700% error would rule the weights)
    # |residual| kept at most this: a window that bursts out of an idle stretch divides by the
    # floor (1e-12 when the recent mean is 0) and would read as a 1e12x residual in every quantile
    residual_cap: float = 10.0
    shrinkage: float = 0.25  # of the error covariance towards its diagonal: 1 is inverse MSE
    quantiles: tuple[float, ...] = (0.5, 0.9)

    def __post_init__(self) -> None:
        if self.error_windows < 1 or self.residual_windows < 1:
            raise ValueError(f"error_windows and residual_windows must be >= 1, got "
                             f"{self.error_windows} and {self.residual_windows}")
        if not 0 < self.error_discount <= 1:
            raise ValueError(f"error_discount must be in (0, 1], got {self.error_discount}")
        if not self.error_cap > 0:
            raise ValueError(f"error_cap must be > 0, got {self.error_cap}")
        if not self.residual_cap > 0:
            raise ValueError(f"residual_cap must be > 0, got {self.residual_cap}")
        if not 0 <= self.shrinkage <= 1:
            raise ValueError(f"shrinkage must be in [0, 1], got {self.shrinkage}")
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


def _errors(series: Series, fcs: dict[str, list[float]], u: int, origin: int, names: Sequence[str],
            cap: float) -> list[float] | None:
    """The members' relative errors on window u; None when it was not observed or had no load."""
    a = _observed(series, u)
    if a is None or a <= 0:
        return None
    return [max(-cap, min(cap, (fcs[name][u - origin] - a) / a)) for name in names]


def _weights(errors: dict[int, list[float] | None], v: int, origin: int, forecasts: list[float],
             p: EnsembleParams) -> tuple[list[float], list[float | None]]:
    """Members' weights for window v from the errors of the windows before it (errors[u], u >= origin)."""
    recent = [(p.error_discount ** k, e) for k in range(min(p.error_windows, v - origin))
              if (e := errors[v - 1 - k]) is not None]
    return combination_weights(recent, forecasts, p.shrinkage)


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
    errors: dict[int, list[float] | None] = {}
    for v in range(start, end):
        for u in range(max(origin, v - p.error_windows), v):
            if u not in errors:
                errors[u] = _errors(series, fcs, u, origin, names, p.error_cap)
        now = [fcs[n][v - origin] for n in names]
        weights, member_errors = _weights(errors, v, origin, now, p)
        point = sum(w * f for w, f in zip(weights, now))
        points[v] = point
        scale = max(point, _floor(series, v, p))
        if v >= first:
            recent = [residuals[u] for u in range(v - p.residual_windows, v) if u in residuals]
            qs = tuple((q, max(0.0, point + scale * empirical_quantile(recent, q)) if recent else point)
                       for q in p.quantiles)
            members = tuple(MemberForecast(n, fcs[n][v - origin], w, e)
                            for n, w, e in zip(names, weights, member_errors))
            out.append(EnsembleForecast(point=point, quantiles=qs, members=members))
        a = _observed(series, v)
        if a is not None:
            residuals[v] = max(-p.residual_cap, min(p.residual_cap, (a - point) / scale))
    return out


def ensemble_series(series: Series, p: EnsembleParams, end: int | None = None) -> list[EnsembleForecast]:
    """The ensemble's forecast of every window 0..end-1 (default: one past the data), each from the windows before it."""
    end = len(series) + 1 if end is None else end
    return _run(series, member_series(series, p.members, end), 0, 0, end, p)


def ensemble_at(series: Series, w: int, p: EnsembleParams) -> EnsembleForecast:
    """The ensemble's forecast of window w (w may be len(series): the next window)."""
    return ensemble_range(series, w, w + 1, p)[0]


def ensemble_range(series: Series, first: int, end: int, p: EnsembleParams) -> list[EnsembleForecast]:
    """The ensemble's forecasts of windows first..end-1 (each as `ensemble_at` gives it), in one pass."""
    if not 0 <= first < end:
        raise ValueError(f"need 0 <= first < end, got {first} and {end}")
    origin = max(0, first - lookback_windows(p))
    fcs = {n: [member_forecast(n, series, v, p.members) for v in range(origin, end)] for n in p.members.members}
    return _run(series, fcs, origin, first, end, p)


__all__ = [
    "EnsembleForecast", "EnsembleParams", "MemberForecast", "empirical_quantile", "ensemble_at", "ensemble_range",
    "ensemble_series",
    "lookback_windows",
]

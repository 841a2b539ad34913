"""WarmServe's corrective seasonal predictor (CSP, §5.1 Eqs. 2-4) and two baselines (pure).

A series is one model's load per window, indexed by window number: `series[w]` is L_w, or
None when the window was not observed (the predictor was down). S windows make one season
(a day in the paper), so L_{k,i} of the paper is `series[k * S + i]`.

    P_w  = mean of L_{w - d S}, d = 1..D, over the observed ones            (Eq. 2)
    Δ_w  = sum_j (L_{w-j} - P_{w-j}) weight(j) / sum_j weight(j), j = 1..N (Eq. 3)
    L̂_w = max(0, P_w + Δ_w)                                              (Eq. 4)

Departures from the printed equations, each because the paper is silent or inconsistent:
- Eq. 3 as printed weighs L_{i-j} by 2^(j-1), so the *oldest* of the N windows weighs most,
  while the text says recent errors weigh more. `weighting="recent"` (the default) follows the
  text, 2^(N-j); `weighting="printed"` is the equation as printed. `tidal bench predictor`
  scores both.
- Missing windows are left out of both sums (Eq. 3 is normalised by the weights actually used).
- With no past season yet, P_w = 0, so the corrective term alone predicts: an exponentially
  weighted mean of the recent loads. Once w has a season, only errors of windows that had one
  too enter Eq. 3 (an error against P = 0 is the whole load, not a correction). The forecast
  is clamped at 0 (a load is never negative).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Series = Sequence[float | None]
Weighting = Literal["recent", "printed"]


@dataclass(frozen=True)
class CspParams:
    windows_per_season: int  # S: windows in one season (a day of 5-minute windows is 288)
    seasons: int | None = None  # D: past seasons averaged; None = every one the series holds
    lookback: int = 10  # N: recent windows in the corrective term (the paper's 10)
    weighting: Weighting = "recent"

    def __post_init__(self) -> None:
        if self.windows_per_season < 1:
            raise ValueError(f"windows_per_season must be >= 1, got {self.windows_per_season}")
        if self.seasons is not None and self.seasons < 1:
            raise ValueError(f"seasons (D) must be >= 1 or None, got {self.seasons}")
        if self.lookback < 1:
            raise ValueError(f"lookback (N) must be >= 1, got {self.lookback}")
        if self.weighting not in ("recent", "printed"):
            raise ValueError(f"weighting must be 'recent' or 'printed', got {self.weighting!r}")

    @classmethod
    def for_windows(cls, window_s: float, season_s: float, **kw: object) -> "CspParams":
        """S from the window and season lengths (the season must be a whole number of windows)."""
        if not window_s > 0 or not season_s > 0:
            raise ValueError(f"window and season must be > 0 seconds, got {window_s} and {season_s}")
        per = season_s / window_s
        if abs(per - round(per)) > 1e-9 or round(per) < 1:
            raise ValueError(f"season ({season_s}s) must be a whole number of windows ({window_s}s)")
        return cls(windows_per_season=round(per), **kw)  # type: ignore[arg-type]


def _at(series: Series, w: int) -> float | None:
    return series[w] if 0 <= w < len(series) else None


def seasonal(series: Series, w: int, p: CspParams) -> float | None:
    """P_w (Eq. 2): the mean load of the same window in the past D seasons; None if none observed."""
    s = p.windows_per_season
    depth = w // s if p.seasons is None else p.seasons
    past = [v for d in range(1, depth + 1) if (v := _at(series, w - d * s)) is not None]
    return sum(past) / len(past) if past else None


def weight(j: int, p: CspParams) -> float:
    """The weight of the error j windows back (j = 1 is the most recent)."""
    return float(2 ** (p.lookback - j)) if p.weighting == "recent" else float(2 ** (j - 1))


def correction(series: Series, w: int, p: CspParams) -> float:
    """Δ_w (Eq. 3): the weighted mean error of the seasonal pattern over the last N windows."""
    seasoned = seasonal(series, w, p) is not None
    total = used = 0.0
    for j in range(1, p.lookback + 1):
        load = _at(series, w - j)
        base = seasonal(series, w - j, p)
        if load is None or (base is not None) != seasoned:
            continue  # missing, or an error against another kind of base (a season vs none)
        total += (load - (base or 0.0)) * weight(j, p)
        used += weight(j, p)
    return total / used if used else 0.0


def predict(series: Series, w: int, p: CspParams) -> float:
    """L̂_w (Eq. 4). `w` may be len(series): the next window."""
    base = seasonal(series, w, p)
    return max(0.0, (base or 0.0) + correction(series, w, p))


def predict_series(series: Series, p: CspParams) -> list[float]:
    """predict(series, w, p) for every w in range(len(series)), computing each P_w once (for scoring)."""
    bases = [seasonal(series, w, p) for w in range(len(series))]
    out = []
    for w, base in enumerate(bases):
        total = used = 0.0
        for j in range(1, min(p.lookback, w) + 1):
            load, past = series[w - j], bases[w - j]
            if load is None or (past is None) != (base is None):
                continue
            total += (load - (past or 0.0)) * weight(j, p)
            used += weight(j, p)
        out.append(max(0.0, (base or 0.0) + (total / used if used else 0.0)))
    return out


def last_value(series: Series, w: int) -> float:
    """Baseline: the last observed window's load (0 before any)."""
    for v in range(min(w, len(series)) - 1, -1, -1):
        if series[v] is not None:
            return float(series[v])  # type: ignore[arg-type]
    return 0.0


def seasonal_naive(series: Series, w: int, windows_per_season: int) -> float:
    """Baseline: the same window one season ago (the last value while there is none)."""
    v = _at(series, w - windows_per_season)
    return float(v) if v is not None else last_value(series, w)


@dataclass(frozen=True)
class LoadForecast:
    avg: float
    peak: float  # never below avg (the peak of a window is at least its mean)


def forecast(avg_series: Series, peak_series: Series, w: int, p: CspParams) -> LoadForecast:
    """CSP for window `w` of the average and the peak series (the paper predicts each alike)."""
    avg = predict(avg_series, w, p)
    return LoadForecast(avg=avg, peak=max(avg, predict(peak_series, w, p)))


def relative_errors(predicted: Sequence[float], actual: Sequence[float]) -> list[float]:
    """|pred - actual| / actual per window, leaving out windows whose actual load is 0."""
    if len(predicted) != len(actual):
        raise ValueError(f"{len(predicted)} predictions for {len(actual)} actual windows")
    return [abs(p - a) / a for p, a in zip(predicted, actual) if a > 0]


__all__ = [
    "CspParams", "LoadForecast", "Series", "correction", "forecast", "last_value", "predict", "predict_series",
    "relative_errors", "seasonal", "seasonal_naive", "weight",
]

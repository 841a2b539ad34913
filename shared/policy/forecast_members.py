"""The forecasters an ensemble combines (pure): each predicts a series' window w from windows < w.

A series is one model's load per window (`series[w]`, None when the window was not observed),
as in shared/policy/warmserve_predictor.py. Members:

- `csp`: WarmServe's corrective seasonal predictor (Eqs. 2-4, the text's weighting);
- `last_value`: the last observed window;
- `seasonal_naive`: the same window one season ago (the last value while there is none);
- `ewma`, `ewma_slow`: exponentially weighted means of the last `span` observed windows
  (smoothing `alpha`: 0.3 and 0.1), normalised by the weights of the windows observed; they
  smooth the Poisson noise that `last_value` passes on whole, at two time scales (the ensemble
  leans on the slow one where noise dominates, on the fast one or CSP where the load moves).

Each member has a pointwise form (`member_forecast`, what the live predictor needs for the few
windows it scores) and a whole-series pass (`member_series`, for benches); both give the same
numbers (tests/predictor/test_forecast_members.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.policy.warmserve_predictor import CspParams, Series, last_value, predict, predict_series, seasonal_naive

MEMBERS = ("csp", "last_value", "seasonal_naive", "ewma", "ewma_slow")


@dataclass(frozen=True)
class MemberParams:
    windows_per_season: int  # S
    lookback: int = 10  # N of CSP's Eq. 3
    ewma_alpha: float = 0.3
    ewma_span: int = 24  # windows the EWMA looks back (0.7^24 < 0.02% of the weight is cut)
    ewma_slow_alpha: float = 0.1
    ewma_slow_span: int = 72  # 0.9^72 < 0.1%
    members: tuple[str, ...] = MEMBERS

    def __post_init__(self) -> None:
        if self.windows_per_season < 1:
            raise ValueError(f"windows_per_season must be >= 1, got {self.windows_per_season}")
        if self.lookback < 1:
            raise ValueError(f"lookback must be >= 1, got {self.lookback}")
        for name, alpha, span in (("ewma", self.ewma_alpha, self.ewma_span),
                                  ("ewma_slow", self.ewma_slow_alpha, self.ewma_slow_span)):
            if not 0 < alpha <= 1 or span < 1:
                raise ValueError(f"{name}: alpha must be in (0, 1] and span >= 1, got {alpha} and {span}")
        if not self.members:
            raise ValueError("an ensemble needs at least one member")
        unknown = [m for m in self.members if m not in MEMBERS]
        if unknown or len(set(self.members)) != len(self.members):
            raise ValueError(f"members must be distinct names from {MEMBERS}, got {self.members}")

    def csp(self) -> CspParams:
        return CspParams(windows_per_season=self.windows_per_season, lookback=self.lookback)


def ewma(series: Series, w: int, alpha: float, span: int) -> float:
    """The weighted mean of the observed windows among the last `span` before w (0 before any)."""
    total = used = 0.0
    for k in range(min(span, w)):
        v = series[w - 1 - k] if w - 1 - k < len(series) else None
        if v is not None:
            wt = (1.0 - alpha) ** k
            total += wt * v
            used += wt
    return total / used if used else 0.0


def member_forecast(name: str, series: Series, w: int, p: MemberParams) -> float:
    """Member `name`'s forecast of window w (w may be len(series): the next window)."""
    if name == "csp":
        return predict(series, w, p.csp())
    if name == "last_value":
        return last_value(series, w)
    if name == "seasonal_naive":
        return seasonal_naive(series, w, p.windows_per_season)
    if name == "ewma":
        return ewma(series, w, p.ewma_alpha, p.ewma_span)
    if name == "ewma_slow":
        return ewma(series, w, p.ewma_slow_alpha, p.ewma_slow_span)
    raise ValueError(f"unknown ensemble member {name!r} (known: {', '.join(MEMBERS)})")


def member_series(series: Series, p: MemberParams, end: int | None = None) -> dict[str, list[float]]:
    """Every member's forecast of windows 0..end-1 (end defaults to len(series) + 1: one past the data)."""
    end = len(series) + 1 if end is None else end
    padded: Sequence[float | None] = list(series) + [None] * max(0, end - len(series))
    out: dict[str, list[float]] = {}
    for name in p.members:
        if name == "csp":
            out[name] = predict_series(padded, p.csp())[:end]
        else:
            out[name] = [member_forecast(name, series, w, p) for w in range(end)]
    return out


__all__ = ["MEMBERS", "MemberParams", "ewma", "member_forecast", "member_series"]

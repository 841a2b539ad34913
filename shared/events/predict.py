"""Family `predict`: per-model load forecasts on `tidal.v1.predict.<model>` (pub/sub).

The predictor turns `DispatchStats` into a load series per model and window and publishes,
once per window, the average and the peak it expects for the next window (WarmServe §4:
the planner prewarms and reserves for the peak), of two loads: the arrival rate and the
concurrency (requests in the system, WarmServe's load). Each comes from an online ensemble of
forecasters (shared/policy/forecast_ensemble.py) with quantiles of the window's mean load, from
which `shared.policy.forecast_outlook.chance_above(p50, p90, level)` prices "a replica is needed".
"""
from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.events.base import MAX_LIST, Message, ModelName, Rate, ServiceId, Timestamp, Value

Concurrency = Annotated[float, Meta(ge=0, le=1e9, description="Requests in the system (running and waiting).")]
Load = Annotated[float, Meta(ge=0, le=1e12)]


class LoadQuantiles(Value, kw_only=True):
    """Quantiles of a window's mean load (rate or concurrency): P(load <= p50) = 0.5, P(load <= p90) = 0.9."""

    p50: Load
    p90: Load

    def __post_init__(self) -> None:
        if self.p90 < self.p50:
            raise ValueError(f"p90 ({self.p90}) must be >= p50 ({self.p50})")


class MemberWeight(Value, kw_only=True):
    """One forecaster of the ensemble: its forecast of the window's mean arrival rate and its weight now."""

    name: Annotated[str, Meta(min_length=1, max_length=32)]
    weight: Annotated[float, Meta(ge=0, le=1)]
    avg_rps: Rate


class Forecast(Message, kw_only=True):
    model: ModelName
    predictor_id: ServiceId
    issued_ts: Timestamp
    window_start_ts: Timestamp  # the window forecast: [window_start_ts, window_start_ts + window_s)
    window_s: Annotated[float, Meta(gt=0, le=86_400)]
    avg_rps: Rate  # expected mean arrival rate, requests/s
    peak_rps: Rate  # expected peak arrival rate within the window, requests/s
    avg_prompt_tokens: Annotated[float, Meta(ge=0)] = 0.0
    avg_output_tokens: Annotated[float, Meta(ge=0)] = 0.0
    observed_rps: Rate | None = None  # what the previous window actually saw
    avg_rps_quantiles: LoadQuantiles | None = None  # of the window's mean rate (None: an older predictor)
    avg_concurrency: Concurrency | None = None  # expected mean requests in the system (None: never measured)
    peak_concurrency: Concurrency | None = None  # expected busiest-slot mean; >= avg_concurrency
    concurrency_quantiles: LoadQuantiles | None = None  # of the window's mean concurrency
    observed_concurrency: Concurrency | None = None  # the previous window's mean concurrency
    members: Annotated[list[MemberWeight], Meta(max_length=MAX_LIST)] = []  # the rate ensemble's, weights sum to 1

    def __post_init__(self) -> None:
        if self.peak_rps < self.avg_rps:
            raise ValueError(f"peak_rps ({self.peak_rps}) must be >= avg_rps ({self.avg_rps})")
        if (self.avg_concurrency is not None and self.peak_concurrency is not None
                and self.peak_concurrency < self.avg_concurrency):
            raise ValueError(f"peak_concurrency ({self.peak_concurrency}) must be >= avg_concurrency "
                             f"({self.avg_concurrency})")


__all__ = ["Concurrency", "Forecast", "LoadQuantiles", "MemberWeight"]

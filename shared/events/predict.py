"""Family `predict`: per-model load forecasts on `tidal.v1.predict.<model>` (pub/sub).

The predictor turns `DispatchStats` into a load series per model and window and publishes,
once per window, the average and the peak it expects for the next window (WarmServe §4:
the planner prewarms and reserves for the peak). Provisional: the CSP predictor (a later
issue) may add fields such as quantiles.
"""
from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.events.base import Message, ModelName, Rate, ServiceId, Timestamp


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

    def __post_init__(self) -> None:
        if self.peak_rps < self.avg_rps:
            raise ValueError(f"peak_rps ({self.peak_rps}) must be >= avg_rps ({self.avg_rps})")


__all__ = ["Forecast"]

"""The predictor's Prometheus metrics (served on its /metrics with the bus and actor metrics)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge

from shared.metrics import REGISTRY

STATS = Counter("tidal_predictor_stats_total", "Dispatcher stats messages counted into a window", registry=REGISTRY)
SKIPPED = Counter(
    "tidal_predictor_skipped_total",
    "Inputs the predictor skipped, by reason (late: its window was closed; future: clock far ahead)",
    ["reason"], registry=REGISTRY,
)
WINDOWS = Counter(
    "tidal_predictor_windows_total", "Windows closed, by whether any dispatcher reported into them",
    ["observed"], registry=REGISTRY,
)
FORECASTS = Counter("tidal_predictor_forecasts_total", "Forecasts published", ["model"], registry=REGISTRY)
PERSIST_ERRORS = Counter(
    "tidal_predictor_persist_errors_total", "Writes of the history to JetStream that failed (retried)",
    registry=REGISTRY,
)
FORECAST_RPS = Gauge(
    "tidal_predictor_forecast_rps",
    "The latest forecast per model: avg, peak or p90 (of the avg) requests/s of the next window",
    ["model", "kind"], registry=REGISTRY,
)
FORECAST_CONCURRENCY = Gauge(
    "tidal_predictor_forecast_concurrency",
    "The latest forecast per model: avg requests in the system over the next window",
    ["model", "kind"], registry=REGISTRY,
)
GUARD_WEIGHT = Gauge(
    "tidal_predictor_guard_weight",
    "The spike guard's lam in the latest forecast per model and series (rps_avg, rps_peak, concurrency_avg, "
    "concurrency_peak): 0 the ensemble as it is, 1 moved all the way to the last window's value",
    ["model", "series"], registry=REGISTRY,
)

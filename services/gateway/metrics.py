"""The gateway's Prometheus metrics (served at `/metrics` on the HTTP port and on the metrics port).

Route labels are the fixed API paths (anything else is "other"), so cardinality stays bounded.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import REGISTRY

ROUTES = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics", "/openapi.json",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize", "/detokenize", "/version",
})

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

HTTP_REQUESTS = Counter(
    "tidal_gateway_requests_total", "HTTP requests answered, by route and status code", ["route", "status"],
    registry=REGISTRY,
)
HTTP_SECONDS = Histogram(
    "tidal_gateway_request_seconds", "HTTP request latency, arrival to the last byte (streams included)", ["route"],
    buckets=_SECONDS, registry=REGISTRY,
)
TTFT_SECONDS = Histogram(
    "tidal_gateway_ttft_seconds", "Time to first token: HTTP arrival to the first generated token's chunk", ["route"],
    buckets=_SECONDS, registry=REGISTRY,
)
TPOT_SECONDS = Histogram(
    "tidal_gateway_tpot_seconds",
    "Time per output token after the first, per finished choice: (last token - first token) / (tokens - 1)", ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=REGISTRY,
)
INFLIGHT_STREAMS = Gauge(
    "tidal_gateway_inflight_streams", "Generations (HTTP requests) in progress, streaming or not", ["route"],
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter(
    "tidal_gateway_generated_tokens_total", "Completion tokens sent to clients", ["route"], registry=REGISTRY,
)
ABORTS = Counter(
    "tidal_gateway_aborts_total", "Requests aborted by the gateway, by reason", ["reason"], registry=REGISTRY,
)
STREAM_ANOMALIES = Counter(
    "tidal_gateway_stream_anomalies_total",
    "Token chunks dropped as duplicates, or gaps skipped in a request's sequence numbers", ["kind"],
    registry=REGISTRY,
)


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


__all__ = [
    "ABORTS", "GENERATED_TOKENS", "HTTP_REQUESTS", "HTTP_SECONDS", "INFLIGHT_STREAMS", "ROUTES", "STREAM_ANOMALIES",
    "TPOT_SECONDS", "TTFT_SECONDS", "route_label",
]

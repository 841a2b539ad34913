"""Prometheus metrics: one registry per process, the bus/actor metrics, and the `/metrics` server.

Every service process owns `REGISTRY` and serves it on its own port (`start_metrics_server`).
Metrics defined here are used by the bus and the actor runtime; services define their own
with `REGISTRY` as the registry, e.g.::

    from prometheus_client import Counter
    from shared.metrics import REGISTRY
    ADMITTED = Counter("tidal_dispatch_admitted_total", "requests admitted", ["model"], registry=REGISTRY)

Label values for `subject` are the *subscription* subject (or an explicit label given to
`Bus.subscribe`), never a concrete per-request subject, so cardinality stays bounded.
"""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

# Latency buckets for loopback request/reply up to multi-second commands.
_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)

MESSAGE_ERRORS = Counter(
    "tidal_message_errors_total",
    "Messages that failed: reason is bad_request / unknown_message (undecodable), "
    "deadline_exceeded (skipped: the caller gave up), internal (handler crashed) or the code a handler raised",
    ["service", "subject", "reason"],
    registry=REGISTRY,
)
HANDLE_SECONDS = Histogram(  # tidal_handle_seconds_count is the number of messages handled
    "tidal_handle_seconds",
    "Time spent in a message handler, per message delivered to a handler (after successful decoding)",
    ["service", "subject"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
REQUEST_SECONDS = Histogram(
    "tidal_request_seconds",
    "Client-side request/reply latency (successful requests)",
    ["service", "subject"],
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
REQUEST_ERRORS = Counter(
    "tidal_request_errors_total",
    "Client-side failed requests by error code (deadline_exceeded, unavailable, or the remote code)",
    ["service", "subject", "code"],
    registry=REGISTRY,
)
TASK_RESTARTS = Counter(
    "tidal_task_restarts_total",
    "Supervised background tasks that crashed and were restarted",
    ["service", "actor", "task"],
    registry=REGISTRY,
)
INFLIGHT = Gauge(
    "tidal_inflight_messages",
    "Messages being handled right now, per actor",
    ["service", "actor"],
    registry=REGISTRY,
)
BUS_EVENTS = Counter(
    "tidal_bus_connection_events_total",
    "NATS connection events (disconnected, reconnected, error, closed)",
    ["service", "event"],
    registry=REGISTRY,
)


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serve REGISTRY at http://host:port/metrics in a daemon thread; returns the bound port.

    `port=0` picks a free port (useful when several services share one host in tests).
    """
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_port)


def sample_value(name: str, labels: dict[str, str]) -> float:
    """The current value of one sample (0.0 when absent); handy in tests and status commands."""
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)

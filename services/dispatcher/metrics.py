"""The dispatcher's Prometheus metrics (served on its /metrics port with the bus metrics)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import REGISTRY

SUBMITS = Counter(
    "tidal_dispatch_submits_total",
    "Submits answered, by outcome: assigned, queued, or the SubmitRejected reason",
    ["outcome"], registry=REGISTRY,
)
ASSIGNMENTS = Counter(
    "tidal_dispatch_assignments_total",
    "Assignments sent to workers, by outcome: accepted, the AssignRejected reason, timeout, no_responders, error",
    ["outcome"], registry=REGISTRY,
)
ASSIGN_SECONDS = Histogram(
    "tidal_dispatch_assign_seconds",
    "Round trip of an Assignment to its worker's reply",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    registry=REGISTRY,
)
CAPACITY_ASKS = Counter(
    "tidal_dispatch_capacity_requests_total",
    "Capacity requests to the planner for a model with no live instance, by outcome: planned, none, unanswered",
    ["outcome"], registry=REGISTRY,
)
REDISPATCHES = Counter(
    "tidal_dispatch_redispatches_total",
    "Requests re-dispatched because their worker died (or stopped answering)",
    registry=REGISTRY,
)
STREAM_ERRORS = Counter(
    "tidal_dispatch_stream_errors_total",
    "Streams the dispatcher ended with a StreamError, by code",
    ["code"], registry=REGISTRY,
)
OWNED = Gauge(
    "tidal_dispatch_owned_requests",
    "Requests this dispatcher admitted and still tracks, by phase (queued, assigning, running)",
    ["phase"], registry=REGISTRY,
)
HINT_ROUTES = Gauge(
    "tidal_dispatch_hint_routes",
    "Requests the `mell` routing policy placed (cumulative): hinted (by the planner's placement hints), "
    "or the reason it fell back to least load (no_hint, stale, no_kv_size, unplaced, unavailable, no_room)",
    ["outcome"], registry=REGISTRY,
)
PREFIX_ROUTES = Gauge(
    "tidal_dispatch_prefix_routes",
    "Requests prefix-aware routing placed (cumulative): `prefix` (an instance held some of the prompt's "
    "blocks: cost = weight x uncached tokens + load) or `load` (none did: the routing policy chose)",
    ["outcome"], registry=REGISTRY,
)

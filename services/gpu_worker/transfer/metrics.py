"""Prometheus metrics of the data plane, per link (`peer` = the other worker's id).

Cardinality is bounded: peers are the workers of the cluster, classes are three.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from shared.metrics import REGISTRY

_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

BANDWIDTH = Gauge(
    "tidal_transfer_link_bandwidth_bytes_per_second",
    "Measured bandwidth of the link to a peer (EWMA over chunk service times)",
    ["peer"], registry=REGISTRY,
)
CHUNK_BYTES = Gauge(
    "tidal_transfer_link_chunk_bytes",
    "Current bulk chunk size of the link (bandwidth x target preemption delay / chunks in flight)",
    ["peer"], registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "tidal_transfer_queue_depth",
    "Transfers queued or being sent on the link, per traffic class",
    ["peer", "cls"], registry=REGISTRY,
)
QUEUED_BYTES = Gauge(
    "tidal_transfer_queued_bytes",
    "Bytes not yet posted on the link, per traffic class (backpressure bound applies to this)",
    ["peer", "cls"], registry=REGISTRY,
)
WAIT_SECONDS = Histogram(
    "tidal_transfer_wait_seconds",
    "Time from submit to a transfer's first chunk on the wire, per traffic class",
    ["peer", "cls"], buckets=_WAIT_BUCKETS, registry=REGISTRY,
)
TRANSFER_SECONDS = Histogram(
    "tidal_transfer_seconds",
    "Time from submit to the receiver's acknowledgement, per traffic class",
    ["peer", "cls"], buckets=_WAIT_BUCKETS, registry=REGISTRY,
)
BYTES = Counter(
    "tidal_transfer_bytes_total",
    "Payload bytes moved, by direction (sent/received) and class",
    ["peer", "cls", "direction"], registry=REGISTRY,
)
CHUNKS = Counter(
    "tidal_transfer_chunks_total",
    "Payload chunks moved, by direction",
    ["peer", "direction"], registry=REGISTRY,
)
FAILURES = Counter(
    "tidal_transfer_failures_total",
    "Transfers that failed, by reason (corrupt, truncated, peer_lost, cancelled, ...) and direction",
    ["peer", "reason", "direction"], registry=REGISTRY,
)
BACKPRESSURE_WAITS = Counter(
    "tidal_transfer_backpressure_waits_total",
    "Submits that had to wait because the class's queued bytes were over the bound",
    ["peer", "cls"], registry=REGISTRY,
)

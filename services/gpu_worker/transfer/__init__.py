"""The data plane: UCX channels between workers and the per-link transfer scheduler.

Bulk tensors (KV blocks, activations, weights) move here, never over NATS. See
docs/dataplane.md for the design, the wire frames and the figures.
"""
from .errors import FAILURE_REASONS, FailureReason, TransferFailed
from .link import Link, TransferHandle, TransferReceipt
from .plane import DataPlane, DataPlaneConfig, format_address, parse_address
from .policy import ChunkingConfig, TrafficClass
from .sink import Inbox, Received, Sink

__all__ = [
    "FAILURE_REASONS",
    "ChunkingConfig",
    "DataPlane",
    "DataPlaneConfig",
    "FailureReason",
    "Inbox",
    "Link",
    "Received",
    "Sink",
    "TrafficClass",
    "TransferFailed",
    "TransferHandle",
    "TransferReceipt",
    "format_address",
    "parse_address",
]

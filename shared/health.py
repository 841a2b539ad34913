"""The health contract every service answers: `tidal.v1.<service>.health` (request/reply).

Kept apart from the service runtime so the subject catalog and schema generator can import
it without pulling in the runtime. Every instance of a service answers (no queue group), so a
plain request gets the first instance's answer and a scatter-gather sees them all.
"""
from __future__ import annotations

from typing import Literal

import msgspec

HEALTH_STATES = ("starting", "ready", "draining")


def health_subject(service: str) -> str:
    """The health subject of a service, e.g. `tidal.v1.dispatcher.health`."""
    if not service or any(c in service for c in ".*> \t"):
        raise ValueError(f"service name: expected a single subject token, got {service!r}")
    return f"tidal.v1.{service}.health"


class HealthRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask a service for its health (no fields)."""


class HealthReply(msgspec.Struct, frozen=True, kw_only=True):
    service: str
    instance: str
    version: str
    uptime_s: float = msgspec.field(default=0.0)
    state: Literal["starting", "ready", "draining"] = "ready"
    inflight: int = 0  # messages being handled by the service's actors
    metrics_port: int | None = None  # where its Prometheus /metrics is served, if anywhere
    # while `starting`: what it is doing (e.g. "loading smollm2-135m-instruct (1/3)"), so a slow start on a
    # busy host reads as progress, not as a hang; `tidal up` prints it and keeps waiting
    progress: str = ""

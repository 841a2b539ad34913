"""What the pure dispatcher core asks its actor to do, and what the actor reports back.

The core (`services.dispatcher.core`) never touches the bus: it returns effects, the actor
performs them and feeds the outcome of each Assignment back in. Keeping I/O out of the core
is what lets its decisions be tested without NATS and replayed exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.events import AbortRequest, AssignAccepted, AssignRejected, Assignment, StreamError, StreamReassigned

from services.dispatcher.cold_start import RequestCapacity  # cold models: ask the planner (cold_start.py)


@dataclass(frozen=True, slots=True)
class SendAssignment:
    """Request/reply `Assignment` on `tidal.v1.worker.<worker_id>.assign`."""

    worker_id: str
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class PublishStreamError:
    """End a request's stream in failure on `tidal.v1.req.<request_id>.out`."""

    error: StreamError


@dataclass(frozen=True, slots=True)
class PublishFence:
    """A re-dispatch's fence on `tidal.v1.req.<request_id>.out`, published before its Assignment
    (same connection, so every consumer sees it before any chunk of the new attempt)."""

    fence: StreamReassigned


@dataclass(frozen=True, slots=True)
class PublishAbort:
    """A targeted `AbortRequest` on `tidal.v1.req.<request_id>.abort`: a worker given up on stops its stale copy."""

    abort: AbortRequest


Effect = SendAssignment | PublishStreamError | PublishFence | PublishAbort | RequestCapacity


@dataclass(frozen=True, slots=True)
class AssignFailed:
    """No typed reply: `timeout` (the worker may still have taken it), `no_responders` (nobody
    listens on its subject: it did not), or `error` (it answered an ErrorReply: it did not)."""

    kind: Literal["timeout", "no_responders", "error"]
    message: str = ""


AssignOutcome = AssignAccepted | AssignRejected | AssignFailed


@dataclass(frozen=True, slots=True)
class AssignmentRecord:
    """One Assignment sent (the dispatcher keeps the latest ones in memory)."""

    ts: float
    request_id: str
    attempt: int
    idempotency_key: str
    worker_id: str
    instance_id: str
    resumed_tokens: int  # tokens re-prefilled (0 on a first dispatch)
    owner: str  # the dispatcher that admitted the request


__all__ = ["AssignFailed", "AssignOutcome", "AssignmentRecord", "Effect", "PublishAbort", "PublishFence",
           "PublishStreamError", "RequestCapacity", "SendAssignment"]

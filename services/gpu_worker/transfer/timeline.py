"""Optional timestamps of every step of a transfer, on both sides (`tidal bench transfer --trace`).

Off by default: each step is one `if timeline.EVENTS is not None` check. When on, steps are
appended as (step, transfer id, chunk index, time.perf_counter()) — CLOCK_MONOTONIC, one
clock for every process of the host, so a sender's and a receiver's timelines line up.

Sender steps: `submit`, `post` (a chunk's frames and payload handed to UCX), `sent` (UCX
done with the payload), `ack` (the receiver's answer read). Receiver steps: `start` (its
TransferStart decoded), `header`, `landed` (payload in memory), `verified` (checksum
matched, chunk accounted), `ack_sent`.
"""
from __future__ import annotations

import time

Event = tuple[str, int, int, float]
EVENTS: list[Event] | None = None


def enable() -> None:
    global EVENTS
    EVENTS = []


def disable() -> list[Event]:
    """Stop recording; the events recorded so far."""
    global EVENTS
    events, EVENTS = EVENTS or [], None
    return events


def mark(step: str, transfer_id: int, index: int = 0) -> None:
    if EVENTS is not None:
        EVENTS.append((step, transfer_id, index, time.perf_counter()))

"""How fast each model's queue drains, measured, and the Retry-After it implies. Pure: time passed in.

A refused client (429 queue_full, 503 no_capacity while an instance starts) is told to come back
when the requests ahead of it are likely served: the queue's length over the rate at which requests
have left it for an instance over the last `WINDOW_S`. With no departure measured yet (a cold
start, a stuck queue), the wait of the queue's head so far is the best lower bound there is.
"""
from __future__ import annotations

from collections import deque

WINDOW_S = 60.0  # departures counted over this long (a few 250 ms intervals would be noise)
MIN_SPAN_S = 5.0  # a rate over less than this is not yet a rate
RETRY_MIN_S = 1.0
RETRY_MAX_S = 300.0  # five minutes: past it a client should rather give up than wait


class DrainRate:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._left: dict[str, deque[float]] = {}  # model -> when requests left its queue (in the window)
        self._since: dict[str, float] = {}  # model -> when this dispatcher started watching its queue

    def queued(self, model: str, now: float) -> None:
        """A request of `model` joined its queue (the measurement starts with the first)."""
        self._since.setdefault(model, now)

    def left(self, model: str, now: float, n: int = 1) -> None:
        """`n` requests left `model`'s queue for an instance."""
        self._since.setdefault(model, now)
        times = self._left.setdefault(model, deque())
        times.extend([now] * n)

    def rate(self, model: str, now: float) -> float | None:
        """Requests per second leaving `model`'s queue over the window; None: not measured yet."""
        times = self._left.get(model)
        while times and times[0] <= now - self.window_s:
            times.popleft()
        span = min(self.window_s, now - self._since.get(model, now))
        if not times or span < MIN_SPAN_S:
            return None
        return len(times) / span

    def retry_after(self, model: str, queued: int, now: float, head_wait_s: float = 0.0) -> float:
        """Seconds until the `queued` requests ahead are likely served (bounded)."""
        rate = self.rate(model, now)
        wait = queued / rate if rate else head_wait_s
        return round(min(RETRY_MAX_S, max(RETRY_MIN_S, wait)), 1)


__all__ = ["DrainRate", "RETRY_MAX_S", "RETRY_MIN_S", "WINDOW_S"]

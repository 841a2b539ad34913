"""How fast each model's queue drains, measured, and the Retry-After it implies. Pure: time passed in.

A refused client (429 queue_full, 503 no_capacity while an instance starts) is told to come back
when the requests ahead of it are likely served: the queue's length over the rate at which requests
have left it for an instance over the last `WINDOW_S`. Until `MIN_SPAN_S` of departures is measured
(a cold burst), the workers' own measured decode rate decides from their first stats interval: the
tokens the queued requests will generate (each its max_tokens, or the mean completion length
finished requests showed when that is shorter) over the tokens per second the model's instances
generate. With neither (no instance has generated yet, a stuck queue), the wait of the queue's
head so far is the best lower bound there is.
"""
from __future__ import annotations

from collections import deque

WINDOW_S = 60.0  # departures counted over this long (a few 250 ms intervals would be noise)
MIN_SPAN_S = 5.0  # a rate over less than this is not yet a rate
RETRY_MIN_S = 1.0
RETRY_MAX_S = 300.0  # five minutes: past it a client should rather give up than wait
LENGTH_WEIGHT = 0.1  # of each finished request in the mean completion length (an EWMA over ~10)


class DrainRate:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._left: dict[str, deque[float]] = {}  # model -> when requests left its queue (in the window)
        self._since: dict[str, float] = {}  # model -> when this dispatcher started watching its queue
        self._mean_tokens: dict[str, float] = {}  # model -> mean completion tokens of finished requests

    def queued(self, model: str, now: float) -> None:
        """A request of `model` joined its queue (the measurement starts with the first)."""
        self._since.setdefault(model, now)

    def left(self, model: str, now: float, n: int = 1) -> None:
        """`n` requests left `model`'s queue for an instance."""
        self._since.setdefault(model, now)
        times = self._left.setdefault(model, deque())
        times.extend([now] * n)

    def finished(self, model: str, completion_tokens: int) -> None:
        """A request of `model` finished after generating `completion_tokens`."""
        mean = self._mean_tokens.get(model)
        self._mean_tokens[model] = float(completion_tokens) if mean is None else \
            mean + LENGTH_WEIGHT * (completion_tokens - mean)

    def expected_tokens(self, model: str, max_tokens: int) -> float:
        """What a queued request with this max_tokens is likely to generate."""
        mean = self._mean_tokens.get(model)
        return float(max_tokens) if mean is None else min(float(max_tokens), max(1.0, mean))

    def rate(self, model: str, now: float) -> float | None:
        """Requests per second leaving `model`'s queue over the window; None: not measured yet."""
        times = self._left.get(model)
        while times and times[0] <= now - self.window_s:
            times.popleft()
        span = min(self.window_s, now - self._since.get(model, now))
        if not times or span < MIN_SPAN_S:
            return None
        return len(times) / span

    def retry_after(self, model: str, queued: int, now: float, head_wait_s: float = 0.0, *,
                    tokens_ahead: float = 0.0, tokens_per_s: float = 0.0) -> float:
        """Seconds until the `queued` requests ahead are likely served (bounded). `tokens_ahead`: what
        they will generate (see `expected_tokens`); `tokens_per_s`: the model's instances' measured
        generation rate now (their latest stats)."""
        rate = self.rate(model, now)
        if rate:
            wait = queued / rate
        elif tokens_per_s > 0 and tokens_ahead > 0:
            wait = tokens_ahead / tokens_per_s
        else:
            wait = head_wait_s
        return round(min(RETRY_MAX_S, max(RETRY_MIN_S, wait)), 1)


__all__ = ["DrainRate", "LENGTH_WEIGHT", "RETRY_MAX_S", "RETRY_MIN_S", "WINDOW_S"]

"""Per-key request rate limits: one token bucket per API key. Pure: time is an argument.

    limiter = RateLimiter(rate=5.0, burst=10)
    wait = limiter.take("key-hash", now)      # 0.0: allowed; else seconds until a token frees
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class TokenBucket:
    tokens: float
    updated: float


class RateLimiter:
    """Token buckets keyed by client key; `rate` tokens per second refill up to `burst`."""

    def __init__(self, rate: float, burst: int = 0, *, max_keys: int = 65536) -> None:
        if rate < 0:
            raise ValueError(f"rate must be >= 0, got {rate}")
        self.rate = rate
        self.burst = float(burst if burst > 0 else max(1, math.ceil(rate)))
        self.max_keys = max_keys
        self.buckets: dict[str, TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def take(self, key: str, now: float) -> float:
        """Take one token for `key`: 0.0 if allowed, else the seconds until one is available."""
        if not self.enabled:
            return 0.0
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.max_keys:
                self._forget_full(now)
            bucket = self.buckets[key] = TokenBucket(tokens=self.burst, updated=now)
        else:
            elapsed = max(0.0, now - bucket.updated)
            bucket.tokens = min(self.burst, bucket.tokens + elapsed * self.rate)
            bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate

    def _forget_full(self, now: float) -> None:
        """Bound memory: a bucket that has refilled to `burst` is the same as a new one."""
        full = [k for k, b in self.buckets.items() if b.tokens + (now - b.updated) * self.rate >= self.burst]
        for key in full:
            del self.buckets[key]
        if len(self.buckets) >= self.max_keys:  # every key is busy: drop the oldest
            oldest = min(self.buckets, key=lambda k: self.buckets[k].updated)
            del self.buckets[oldest]


__all__ = ["RateLimiter", "TokenBucket"]

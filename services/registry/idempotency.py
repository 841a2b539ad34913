"""Remembered outcomes of applied writes, by idempotency key (pure; time passed in).

A client that retries a put or delete (its reply was lost) sends the same idempotency key;
the registry answers with the outcome it already applied (`replayed=True`) instead of a
conflict against its own earlier write. Entries are bounded in number and age, and live in
memory: a retry that reaches a restarted registry gets the compare-and-set answer instead
(a conflict naming the current revision), which is still safe: nothing is written twice.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from shared.wire import BadRequest

V = TypeVar("V")


class IdempotencyCache(Generic[V]):
    def __init__(self, *, max_entries: int = 10_000, ttl_s: float = 600.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, tuple[float, tuple[object, ...], V]] = OrderedDict()

    def lookup(self, key: str, fingerprint: tuple[object, ...], now: float) -> V | None:
        """The remembered outcome of `key`, or None. Raises BadRequest when the key was used
        for a different write (a client bug that must not be answered as a success)."""
        self._evict(now)
        found = self._entries.get(key)
        if found is None:
            return None
        if found[1] != fingerprint:
            raise BadRequest(
                f"idempotency key {key!r} was already used for a different write", field="idempotency_key"
            )
        return found[2]

    def remember(self, key: str, fingerprint: tuple[object, ...], outcome: V, now: float) -> None:
        self._entries[key] = (now, fingerprint, outcome)
        self._entries.move_to_end(key)
        self._evict(now)

    def _evict(self, now: float) -> None:
        while self._entries:
            oldest_key, (stamp, _, _) = next(iter(self._entries.items()))
            if len(self._entries) <= self.max_entries and now - stamp < self.ttl_s:
                break
            del self._entries[oldest_key]

    def __len__(self) -> int:
        return len(self._entries)

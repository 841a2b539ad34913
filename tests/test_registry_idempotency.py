"""The registry's memory of applied writes by idempotency key (pure)."""
from __future__ import annotations

import pytest

from services.registry.idempotency import IdempotencyCache
from shared.wire import BadRequest


def test_same_key_same_write_is_remembered_a_different_write_is_refused():
    cache: IdempotencyCache[str] = IdempotencyCache()
    assert cache.lookup("k", ("put", 1), now=0.0) is None
    cache.remember("k", ("put", 1), "rev-7", now=0.0)
    assert cache.lookup("k", ("put", 1), now=1.0) == "rev-7"
    with pytest.raises(BadRequest):
        cache.lookup("k", ("put", 2), now=1.0)


def test_bounded_by_age_and_count():
    cache: IdempotencyCache[int] = IdempotencyCache(max_entries=2, ttl_s=10.0)
    cache.remember("a", (), 1, now=0.0)
    cache.remember("b", (), 2, now=1.0)
    cache.remember("c", (), 3, now=2.0)  # evicts the oldest
    assert cache.lookup("a", (), now=2.0) is None and cache.lookup("b", (), now=2.0) == 2
    assert cache.lookup("b", (), now=11.0) is None  # expired
    assert len(cache) == 1

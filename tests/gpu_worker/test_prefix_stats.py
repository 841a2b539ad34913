"""PrefixRates (services/gpu_worker/prefix_stats.py): the prefix cache's figures for InstanceStats, its hit
rate over the recent window, and nothing for an engine without a cache."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.gpu_worker.prefix_stats import PrefixRates


class Cache:
    """The engine cache's agreed read interface, driven by the test."""

    def __init__(self) -> None:
        self.queried, self.hits, self.entries, self.cached_free_kv_blocks = 0, 0, 0, 0

    def hit_stats(self) -> tuple[int, int]:
        return self.queried, self.hits

    def cached_free_blocks(self) -> int:
        return self.entries


def instance(cache: object) -> SimpleNamespace:
    return SimpleNamespace(instance_id="i1", block_bytes=1024, engine=SimpleNamespace(prefix_cache=cache))


def test_the_hit_rate_is_over_the_window_and_bytes_are_the_per_layer_blocks() -> None:
    cache, rates = Cache(), PrefixRates(window_s=10.0)
    inst = instance(cache)
    assert rates.fields(inst, 0.0)["prefix_hit_rate"] == 0.0  # no look-ups yet
    cache.queried, cache.hits, cache.entries, cache.cached_free_kv_blocks = 100, 90, 3, 6  # 3 entries x 2 layers
    got = rates.fields(inst, 5.0)
    assert got["prefix_hit_rate"] == pytest.approx(0.9)
    assert (got["prefix_cached_free_blocks"], got["prefix_cached_free_bytes"]) == (3, 6 * 1024)
    assert (got["prefix_queried_blocks"], got["prefix_hit_blocks"]) == (100, 90)
    cache.queried, cache.hits = 200, 90  # 100 more looked up, none hit
    # the base is the latest reading at or before the window's start: t=0 for (2, 12], t=5 for (6, 16]
    assert rates.fields(inst, 12.0)["prefix_hit_rate"] == pytest.approx(90 / 200)
    assert rates.fields(inst, 16.0)["prefix_hit_rate"] == pytest.approx(0.0)
    assert rates.fields(inst, 30.0)["prefix_hit_rate"] == 0.0  # nothing looked up within the last 10 s: cold


def test_no_cache_no_fields() -> None:
    rates = PrefixRates()
    assert rates.fields(instance(None), 1.0) == {}
    assert rates.fields(SimpleNamespace(instance_id="i2", block_bytes=1, engine=object()), 1.0) == {}  # predates it

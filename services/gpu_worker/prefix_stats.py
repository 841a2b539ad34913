"""The prefix cache's figures in `InstanceStats` (prefix_* fields): what the memory economy prices.

Read from the engine's `prefix_cache` (services/gpu_worker/engine/prefix_cache.py; None when caching is
off, absent on an engine that predates it: then no field is set and they keep their 0 defaults) through
its thread-safe interface: `cached_free_blocks()` (entries: token blocks over every held layer, the unit
of `EvictPrefixBlocks`), `cached_free_kv_blocks` (the same in the block manager's per-layer blocks: their
bytes) and `hit_stats()` (cumulative blocks looked up and hit). The hit rate is taken over the last
`window_s` of the publisher's readings, so it is recent: a cache nobody hit lately prices as cold. No I/O.
"""
from __future__ import annotations

from collections import deque
from typing import Any

from shared.policy.prefix_price import reuse_chance

WINDOW_S = 30.0  # the hit rate's window: a few planning horizons (the arbiter's default horizon is 10 s)


class PrefixRates:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[str, deque[tuple[float, int, int]]] = {}  # instance id -> (ts, queried, hits)

    def fields(self, inst: Any, now: float) -> dict[str, Any]:
        """InstanceStats keyword arguments for `inst` now ({} when its engine caches no prefixes)."""
        cache = getattr(getattr(inst, "engine", None), "prefix_cache", None)
        if cache is None:
            self._seen.pop(getattr(inst, "instance_id", ""), None)
            return {}
        queried, hits = (int(x) for x in cache.hit_stats())
        entries = int(cache.cached_free_blocks())
        kv_blocks = getattr(cache, "cached_free_kv_blocks", None)
        if not isinstance(kv_blocks, int):  # an entry is one block on every layer the instance holds
            kv_blocks = entries * len(getattr(cache, "layers", ()) or (1,))
        seen = self._seen.setdefault(inst.instance_id, deque())
        seen.append((now, queried, hits))
        while len(seen) > 1 and seen[1][0] <= now - self.window_s:
            seen.popleft()  # keep one reading at or before the window's start as its base
        _, q0, h0 = seen[0]
        return {"prefix_cached_free_blocks": entries, "prefix_cached_free_bytes": kv_blocks * int(inst.block_bytes),
                "prefix_hit_rate": reuse_chance(max(0, queried - q0), max(0, hits - h0)),
                "prefix_queried_blocks": queried, "prefix_hit_blocks": hits}

    def forget(self, keep: set[str]) -> None:
        """Drop the readings of instances no longer here."""
        for iid in [i for i in self._seen if i not in keep]:
            del self._seen[iid]


__all__ = ["PrefixRates", "WINDOW_S"]

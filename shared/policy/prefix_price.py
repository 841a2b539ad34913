"""The price of cached prefix blocks on the memory market (pure): what giving them up costs later.

A cached-free prefix block (its KV computed by an earlier request, held by no running one, kept so that
a later request with the same prefix skips that prefill — vLLM's automatic prefix caching, our engine's
`PrefixCache`) is device memory the arbiter may take back. Releasing it costs nothing now; it costs the
prefill of its tokens if a request would have reused it. In request-seconds (the market's unit):

    price = chance of reuse x tokens x prefill seconds per token

- **chance of reuse**: the holder's recent block hit rate (hit blocks / looked-up blocks over the last
  window). Measured per *instance*, not per prefix: the engine's `PrefixCache.hit_stats()` reports one
  pair of counters for the whole cache, so every cached block of an instance is priced as likely to be
  reused as the instance's blocks were lately. Within one instance the engine evicts least recently used
  first, so the blocks a purchase takes are its coldest; across instances a cold cache (low hit rate) is
  cheaper per byte than a hot one, so `memory_market.buy` takes the cold one first and keeps the hot.
  An instance with no look-ups in the window has no evidence of reuse: its chance is 0.
- **prefill seconds per token**: the cost profile's `[step] prefill_per_token_s` (the one the simulator
  and every other price use: `PrefillCost`). The step's fixed overhead is not counted: a request that
  misses the cache prefills anyway, only longer.

Assumed, not measured: a released block would be reused at most once within the horizon (the first
request that misses recomputes and caches it again), and at the instance's average hit rate. No
constant of its own.
"""
from __future__ import annotations

import math


def reuse_chance(queried_blocks: float, hit_blocks: float) -> float:
    """The recent block hit rate in [0, 1] from a window's look-ups and hits (0 with no look-ups)."""
    if queried_blocks < 0 or hit_blocks < 0:
        raise ValueError(f"prefix hit stats must be >= 0 (got {queried_blocks} looked up, {hit_blocks} hit)")
    if queried_blocks == 0:
        return 0.0
    return min(1.0, hit_blocks / queried_blocks)


def price_prefix_eviction(chance: float, tokens: int, prefill_per_token_s: float) -> float:
    """Releasing `tokens` tokens of cached prefix KV: with the chance a request reuses them, that request
    prefills them again."""
    if not 0.0 <= chance <= 1.0 or not math.isfinite(chance):
        raise ValueError(f"a chance must be in [0, 1], got {chance}")
    if tokens < 0 or prefill_per_token_s < 0:
        raise ValueError(f"prefix eviction: tokens and prefill cost must be >= 0 (got {tokens}, {prefill_per_token_s})")
    return chance * tokens * prefill_per_token_s


def blocks_for(need_bytes: int, held_blocks: int, block_bytes: int) -> int:
    """How many cached blocks (least recently used first) a purchase for `need_bytes` takes: enough to cover
    it, never more than are held (0 when none are, or a block has no size)."""
    if held_blocks <= 0 or block_bytes <= 0 or need_bytes <= 0:
        return 0
    return min(held_blocks, -(-need_bytes // block_bytes))


__all__ = ["blocks_for", "price_prefix_eviction", "reuse_chance"]

"""A request's KV blocks as data-plane buffers: sent from the cache, received into the cache.

The paged cache keeps all blocks' K halves in one array and all V halves in another
(`engine.kv_cache.PagedKVCache`), so one layer's blocks are rows of those arrays. A
transfer's byte stream is, for each layer in ascending order: the K rows of its blocks in
table order, then their V rows. Both sides build the same stream from their own block
tables (same layers, same number of blocks per layer; the block ids differ), the sender
from `BlockManager.export_tables`, the receiver from `import_tables` — and the data plane
moves the rows with no copy other than the staging of chunks that span several runs.

Consecutive block ids are coalesced into one view, so a request whose blocks were
allocated together is a handful of large segments rather than thousands of small ones.
`first_block`/`last_block` select a slice of every layer's table: pre-copy migration sends
the full blocks first and the tail (the blocks still being written) in the final stop.
"""
from __future__ import annotations

from typing import Any

import torch


def block_runs(ids: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10, 2] -> [(3, 6), (9, 11), (2, 3)]: half-open runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in ids:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


def kv_block_views(cache: Any, tables: dict[int, list[int]], first_block: int = 0,
                   last_block: int | None = None) -> list[torch.Tensor]:
    """Views of the cache rows of `tables[layer][first_block:last_block]` for every layer, in
    stream order (see the module doc). `cache` is a PagedKVCache (its `keys`/`values`)."""
    views: list[torch.Tensor] = []
    for layer in sorted(tables):
        ids = tables[layer][first_block:last_block]
        for half in (cache.keys, cache.values):
            views.extend(half[a:b] for a, b in block_runs(ids))
    return views


def kv_stream_bytes(cache: Any, tables: dict[int, list[int]], first_block: int = 0,
                    last_block: int | None = None) -> int:
    """Bytes of the stream `kv_block_views` describes (both sides check they agree)."""
    return sum(v.numel() * v.element_size() for v in kv_block_views(cache, tables, first_block, last_block))

"""Moving one sequence's block tables out and in (live migration, buddy-group exchange): the
block manager's table export/import, kept apart from its allocation logic. Pure Python."""
from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gpu_worker.engine.block_allocator import BlockAllocator


class BlockManagerError(RuntimeError):
    pass


def layer_tuple(layers: Iterable[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(layers)))
    if any(not isinstance(l, int) or l < 0 for l in out):
        raise ValueError(f"layers must be non-negative integers, got {out}")
    return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TableTransfer:
    """BlockManager's migration calls (a mixin over its tables, lock and allocator)."""

    block_size: int
    _layers: tuple[int, ...]
    _tables: dict[str, dict[int, list[int]]]
    _lock: threading.RLock
    _alloc: BlockAllocator

    def _release(self, owner: Hashable, ids: list[int]) -> None: ...
    def _claim(self, short: int) -> bool: ...
    def _new_seq(self, seq_id: str) -> dict[int, list[int]]: ...
    def _refresh_covered(self, seq_id: str) -> None: ...

    def export_tables(self, seq_id: str, layers: Iterable[int]) -> dict[int, list[int]]:
        """Copies of the tables for `layers` (the data plane reads those blocks)."""
        tables = self._tables[seq_id]
        layers = layer_tuple(layers)
        missing = [l for l in layers if l not in tables]
        if missing:
            raise BlockManagerError(f"sequence {seq_id}: layers {missing} are not held here")
        return {l: list(tables[l]) for l in layers}

    def release_layers(self, seq_id: str, layers: Iterable[int]) -> int:
        """Free one sequence's blocks for `layers` (after its KV there was exported)."""
        tables = self._tables[seq_id]
        n = 0
        with self._lock:
            for l in layer_tuple(layers):
                table = tables.get(l, [])
                self._release((seq_id, l), table)
                n += len(table)
                table.clear()
        self._refresh_covered(seq_id)
        return n

    def import_tables(self, seq_id: str, layers: Iterable[int], num_tokens: int) -> dict[int, list[int]] | None:
        """Fresh blocks for `layers` covering `num_tokens` (the data plane fills them);
        None, with nothing allocated, if they do not fit."""
        layers = layer_tuple(layers)
        bad = [l for l in layers if l not in self._layers]
        if bad:
            raise BlockManagerError(f"sequence {seq_id}: cannot import layers {bad}: held layers are {self._layers}")
        need = cdiv(num_tokens, self.block_size)
        tables = self._tables.get(seq_id)
        current = {l: len(tables[l]) if tables else 0 for l in layers}
        if any(n for n in current.values()):
            raise BlockManagerError(f"sequence {seq_id}: layers already have blocks: {current}")
        with self._lock:
            short = need * len(layers) - self._alloc.num_free
            if short > 0 and not self._claim(short):
                return None
            tables = tables or self._new_seq(seq_id)
            for l in layers:
                tables[l] = self._alloc.take((seq_id, l), need, None, need)
        self._refresh_covered(seq_id)
        return {l: tables[l] for l in layers}

"""Paged KV blocks with a block table per sequence per layer. Pure Python, no torch.

A block is one layer's K and V for `block_size` tokens, so any layer's KV can take any
free block and the KV storage is one array of blocks shared by all held layers. The
number of blocks is whatever the memory pool can give the KV kind: `sync_with_pool`
claims free pool bytes as new blocks (after weights were dropped, say), and the pool
calls back `_reclaim` when another kind needs bytes, which gives up FREE blocks only.

Block ids are stable for the life of a block; retired ids are reused first, so the
runner sizes its KV storage by `block_id_limit`. Which free ids a chain gets is the
allocator's business (`block_allocator`: contiguous chains when it can).
"""
from __future__ import annotations

from collections.abc import Iterable

from services.gpu_worker.engine.block_allocator import BlockAllocator
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool


class BlockManagerError(RuntimeError):
    pass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layer_tuple(layers: Iterable[int]) -> tuple[int, ...]:
    out = tuple(sorted(set(layers)))
    if any(not isinstance(l, int) or l < 0 for l in out):
        raise ValueError(f"layers must be non-negative integers, got {out}")
    return out


class BlockManager:
    def __init__(
        self,
        pool: MemoryPool,
        *,
        block_size: int,
        block_bytes: int,
        layers: Iterable[int],
        owner: str = "kv",
        max_blocks: int | None = None,
        reserve_bytes: int = 0,
    ) -> None:
        if block_size < 1 or block_bytes < 1:
            raise ValueError(f"block_size and block_bytes must be >= 1, got {block_size}, {block_bytes}")
        self.pool = pool
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks  # cap, e.g. a fixed preallocated KV region
        self.reserve_bytes = reserve_bytes  # left free in the pool for workspace spikes
        self._layers = _layer_tuple(layers)
        self._charge = pool.charge(MemoryKind.KV, owner, 0)
        self._num_blocks = 0
        self._alloc = BlockAllocator()
        self._tables: dict[str, dict[int, list[int]]] = {}
        self._covered: dict[str, int] = {}  # min blocks per held layer, the fast path
        pool.register_reclaimer(MemoryKind.KV, self._reclaim)
        self.sync_with_pool()

    # --- capacity --------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._alloc.num_free

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self._alloc.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks if self._num_blocks else 0.0

    @property
    def block_id_limit(self) -> int:
        """Every live block id is below this: the KV storage must have this many slots."""
        return self._alloc.limit

    @property
    def token_capacity(self) -> int:
        """Tokens one sequence could hold if it had every block."""
        return (self._num_blocks // max(1, len(self._layers))) * self.block_size

    def sync_with_pool(self) -> int:
        """Claim the pool's free bytes (minus the reserve) as new blocks; returns how many."""
        spare = self.pool.free_bytes - self.reserve_bytes
        n = max(0, spare // self.block_bytes)
        if self.max_blocks is not None:
            n = min(n, self.max_blocks - self._num_blocks)
        if n <= 0:
            return 0
        self.pool.resize(self._charge, (self._num_blocks + n) * self.block_bytes, reclaim=False)
        self._alloc.add(n)
        self._num_blocks += n
        return n

    def give_back(self, nbytes: int) -> int:
        """Retire free blocks until `nbytes` are returned to the pool (or none are free); bytes given."""
        # the highest free ids go, so the storage can shrink at its end
        n = self._alloc.retire(cdiv(max(0, nbytes), self.block_bytes))
        if n <= 0:
            return 0
        self._num_blocks -= n
        self.pool.resize(self._charge, self._num_blocks * self.block_bytes)
        return n * self.block_bytes

    def _reclaim(self, missing_bytes: int) -> int:
        return self.give_back(missing_bytes)

    # --- layers ----------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return self._layers

    def set_layers(self, layers: Iterable[int]) -> None:
        """Change the held layers (normally a contiguous range). Blocks of layers no longer held
        are freed (export them first); layers newly held start with empty tables, to be
        imported or recomputed."""
        layers = _layer_tuple(layers)
        for seq_id, tables in self._tables.items():
            for layer in [l for l in tables if l not in layers]:
                self._alloc.release((seq_id, layer), tables.pop(layer))
            for layer in layers:
                tables.setdefault(layer, [])
        self._layers = layers
        for seq_id in self._tables:
            self._refresh_covered(seq_id)

    # --- per sequence --------------------------------------------------------------------
    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def block_tables(self, seq_id: str) -> dict[int, list[int]]:
        """layer -> block ids; the manager's own lists, read-only for callers."""
        return self._tables[seq_id]

    def num_blocks_of(self, seq_id: str) -> int:
        return sum(len(t) for t in self._tables.get(seq_id, {}).values())

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        need = cdiv(num_tokens, self.block_size)
        tables = self._tables.get(seq_id)
        if tables is None:
            return need * len(self._layers)
        if self._covered[seq_id] >= need:
            return 0
        return sum(max(0, need - len(tables[layer])) for layer in self._layers)

    def can_allocate(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self._alloc.num_free

    def allocate(self, seq_id: str, num_tokens: int, expected_tokens: int = 0) -> bool:
        """Make every held layer's table cover `num_tokens` tokens: all or nothing.
        `expected_tokens` (e.g. prompt + max_tokens) lets chains stay contiguous as they grow."""
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed == 0:
            if seq_id not in self._tables:
                self._new_seq(seq_id)
            return True
        if needed > self._alloc.num_free:
            return False
        tables = self._tables.get(seq_id) or self._new_seq(seq_id)
        need = cdiv(num_tokens, self.block_size)
        expect = max(need, cdiv(expected_tokens, self.block_size))
        take = self._alloc.take
        for layer in self._layers:
            table = tables[layer]
            if len(table) < need:
                table += take((seq_id, layer), need - len(table), table[-1] if table else None, expect - len(table))
        self._covered[seq_id] = need
        return True

    def free(self, seq_id: str) -> int:
        """Give back all of a sequence's blocks; returns how many."""
        tables = self._tables.pop(seq_id, None)
        self._covered.pop(seq_id, None)
        if not tables:
            return 0
        n = 0
        for layer, table in tables.items():
            self._alloc.release((seq_id, layer), table)
            n += len(table)
        return n

    def _new_seq(self, seq_id: str) -> dict[int, list[int]]:
        tables: dict[int, list[int]] = {layer: [] for layer in self._layers}
        self._tables[seq_id] = tables
        self._covered[seq_id] = 0
        return tables

    def _refresh_covered(self, seq_id: str) -> None:
        tables = self._tables[seq_id]
        self._covered[seq_id] = min((len(tables[l]) for l in self._layers), default=0)

    # --- migration -----------------------------------------------------------------------
    def export_tables(self, seq_id: str, layers: Iterable[int]) -> dict[int, list[int]]:
        """Copies of the tables for `layers` (the data plane reads those blocks)."""
        tables = self._tables[seq_id]
        layers = _layer_tuple(layers)
        missing = [l for l in layers if l not in tables]
        if missing:
            raise BlockManagerError(f"sequence {seq_id}: layers {missing} are not held here")
        return {l: list(tables[l]) for l in layers}

    def release_layers(self, seq_id: str, layers: Iterable[int]) -> int:
        """Free one sequence's blocks for `layers` (after its KV there was exported)."""
        tables = self._tables[seq_id]
        n = 0
        for l in _layer_tuple(layers):
            table = tables.get(l, [])
            self._alloc.release((seq_id, l), table)
            n += len(table)
            table.clear()
        self._refresh_covered(seq_id)
        return n

    def import_tables(self, seq_id: str, layers: Iterable[int], num_tokens: int) -> dict[int, list[int]] | None:
        """Fresh blocks for `layers` covering `num_tokens` (the data plane fills them);
        None, with nothing allocated, if they do not fit."""
        layers = _layer_tuple(layers)
        bad = [l for l in layers if l not in self._layers]
        if bad:
            raise BlockManagerError(f"sequence {seq_id}: cannot import layers {bad}: held layers are {self._layers}")
        need = cdiv(num_tokens, self.block_size)
        tables = self._tables.get(seq_id)
        current = {l: len(tables[l]) if tables else 0 for l in layers}
        if any(n for n in current.values()):
            raise BlockManagerError(f"sequence {seq_id}: layers already have blocks: {current}")
        if need * len(layers) > self._alloc.num_free:
            return None
        tables = tables or self._new_seq(seq_id)
        for l in layers:
            tables[l] = self._alloc.take((seq_id, l), need, None, need)
        self._refresh_covered(seq_id)
        return {l: tables[l] for l in layers}

    def stats(self) -> dict[str, int]:
        return {
            "num_blocks": self._num_blocks,
            "used_blocks": self.num_used_blocks,
            "free_blocks": self.num_free_blocks,
            "block_size": self.block_size,
            "kv_bytes": self._num_blocks * self.block_bytes,
            "kv_used_bytes": self.num_used_blocks * self.block_bytes,
            "num_layers": len(self._layers),
        }

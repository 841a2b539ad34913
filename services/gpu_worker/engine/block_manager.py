"""Paged KV blocks with a block table per sequence per layer. Pure Python, no torch.

A block is one layer's K and V for `block_size` tokens, so any layer's KV can take any
free block and the KV storage is one array of blocks shared by all held layers. The
number of blocks is whatever the memory pool can give the KV kind: `sync_with_pool`
claims free pool bytes as new blocks (after weights were dropped, say), and the pool
calls back `_reclaim` when another kind needs bytes, which gives up FREE blocks only.

A worker's instances share one pool (one block manager each, on its own engine thread),
so the number of blocks also moves between instances, never copying live KV:
* an allocation that finds too few free blocks claims pool bytes at once — the free
  ones, then other instances' free blocks (`MemoryPool.reclaim_kv`) — in batches of
  `claim_batch` blocks, so that growth does not ask the pool every step;
* what it still lacks is filed as a *want* once per step (`settle`, called by the
  scheduler): the pool earmarks freed bytes for the oldest want, and every manager gives
  its free blocks back to cover other instances' wants at the start of its next step;
* an instance keeps `floor_blocks` free blocks from other instances' claims while it
  holds live KV (hysteresis: two busy instances do not trade blocks back and forth),
  none while it is idle.
All touching of free blocks happens under the pool's one lock (another instance's thread
may be retiring them); the hot path — a sequence whose blocks already cover its next
tokens — takes no lock.

With prefix caching (`prefix_cache.py`, on unless `prefix_model` is None) a full block may be
shared by several sequences' tables, and kept after its last user as *cached-free*: such blocks
count as free, and every path above that takes free blocks (allocation, the pool's reclaim,
other instances' wants, `set_cap`) evicts them, least recently used first, when the plain free
ones do not cover it (an allocation takes unused pool bytes before it evicts).

Block ids are stable for the life of a block; retired ids are reused first, so the
runner sizes its KV storage by `block_id_limit`. Which free ids a chain gets is the
allocator's business (`block_allocator`: contiguous chains when it can).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING

from services.gpu_worker.engine.block_allocator import BlockAllocator
from services.gpu_worker.engine.block_tables_io import (
    BlockManagerError, TableTransfer, cdiv, layer_tuple as _layer_tuple,
)
from services.gpu_worker.engine.memory_pool import MemoryKind, MemoryPool
from services.gpu_worker.engine.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from services.gpu_worker.engine.sequence import Sequence

__all__ = ["BlockManager", "BlockManagerError", "cdiv"]


class BlockManager(TableTransfer):
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
        claim_batch: int | None = None,
        floor_blocks: int | None = None,
        on_retire: Callable[[list[int]], None] | None = None,
        on_grow: Callable[[list[int]], None] | None = None,
        prefix_model: str | None = None,
    ) -> None:
        if block_size < 1 or block_bytes < 1:
            raise ValueError(f"block_size and block_bytes must be >= 1, got {block_size}, {block_bytes}")
        self.pool = pool
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks  # cap, e.g. a fixed preallocated KV region
        self.cap_blocks: int | None = None  # WarmServe Eq. 1: a grace-period instance's KV cap (set_cap)
        self.reserve_bytes = reserve_bytes  # left free in the pool for workspace spikes
        self._layers = _layer_tuple(layers)
        per_step = max(1, len(self._layers))  # blocks one sequence takes at a block boundary
        self.claim_batch = claim_batch if claim_batch is not None else 4 * per_step
        self.floor = floor_blocks if floor_blocks is not None else 2 * per_step
        self.on_retire = on_retire  # e.g. give the retired blocks' physical memory back
        self.on_grow = on_grow  # e.g. map device memory behind new block ids (CUDA VMM) before use
        self._root = pool.root  # the shared pool behind a tenant's view
        self._tenant = pool.tenant
        self._lock = self._root.lock
        self._short = 0  # KV bytes this step's allocations lacked (filed as a want by settle)
        self._wanting = False
        self._charge = pool.charge(MemoryKind.KV, owner, 0)
        self._num_blocks = 0
        self._alloc = BlockAllocator()
        # automatic prefix caching (prefix_cache.py), named under `prefix_model`; None: off
        self.prefix = PrefixCache(block_size=block_size, model=prefix_model, layers=self._layers, lock=self._lock,
                                  release=lambda ids: self._alloc.release(None, ids)) if prefix_model else None
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
        """Free blocks, counting cached-free prefix blocks (evicted on demand)."""
        return self._alloc.num_free + (self.prefix.cached_free_kv_blocks if self.prefix is not None else 0)

    @property
    def num_cached_blocks(self) -> int:
        """Of the free blocks, those that hold a cached prefix nobody uses now."""
        return self.prefix.cached_free_kv_blocks if self.prefix is not None else 0

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - self.num_free_blocks  # live: cached-free prefix blocks count as free

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

    @property
    def floor_blocks(self) -> int:
        """Free blocks other instances may not take: the floor while this one holds live KV."""
        return self.floor if self._tables else 0

    @property
    def capacity_blocks(self) -> int:
        """The most blocks this manager could ever hold: its own, the pool's free bytes and
        every other instance's KV were it all freed (less the reserve). "Fits at all" is
        judged by this; `num_blocks` is what it holds now."""
        with self._lock:
            kv_bytes = self._root.bytes_of(MemoryKind.KV)
            n = max(0, (self._root.free_bytes + kv_bytes - self.reserve_bytes) // self.block_bytes)
        n = n if self.max_blocks is None else min(n, self.max_blocks)
        return n if self.cap_blocks is None else min(n, max(self.cap_blocks, self._num_blocks))

    def set_cap(self, max_bytes: int | None) -> int:
        """Hold at most `max_bytes` of KV from now on (None: no cap). Free blocks above the cap go back
        to the pool at once (room for prewarmed weights, WarmServe §4.1); live blocks stay, and no new
        ones are claimed past it. Returns the bytes given back."""
        with self._lock:
            if max_bytes is None:
                self.cap_blocks = None
                return 0
            self.cap_blocks = max(0, max_bytes) // self.block_bytes
            over = self._num_blocks - self.cap_blocks
            return self._retire_free(over, keep_floor=False) if over > 0 else 0

    def sync_with_pool(self) -> int:
        """At the start of a step: give free blocks back to instances that wait for KV, then
        claim the free bytes left to this one (minus the reserve) as new blocks; returns how many."""
        root = self._root
        if not root.has_wants and root.free_bytes - self.reserve_bytes < self.block_bytes:
            return 0  # the common case, without the lock: nobody waits, nothing to claim
        with self._lock:
            deficit = self._root.wanted_by_others(self._tenant)
            if deficit > 0:
                self._retire_free(cdiv(deficit, self.block_bytes), keep_floor=True)
            return self._add_blocks(self._root.available_to(self._tenant) // self.block_bytes)

    def settle(self) -> None:
        """At the end of scheduling: file what this step's allocations lacked as this instance's
        want (or withdraw it), so freed blocks elsewhere come here. Once per step."""
        if self._short or self._wanting:
            self._root.set_want(self._tenant, self._short)
            self._wanting, self._short = self._short > 0, 0

    def give_back(self, nbytes: int) -> int:
        """Retire free blocks until `nbytes` are returned to the pool (or none are free); bytes given."""
        with self._lock:
            return self._retire_free(cdiv(max(0, nbytes), self.block_bytes), keep_floor=False)

    def _reclaim(self, missing_bytes: int, keep_floor: bool) -> int:
        """The pool's callback (any thread, pool lock held): free blocks for another kind or instance."""
        return self._retire_free(cdiv(max(0, missing_bytes), self.block_bytes), keep_floor)

    def _add_blocks(self, n: int) -> int:
        n = min(n, (self._root.available_to(self._tenant) - self.reserve_bytes) // self.block_bytes)
        if self.max_blocks is not None:
            n = min(n, self.max_blocks - self._num_blocks)
        if self.cap_blocks is not None:
            n = min(n, self.cap_blocks - self._num_blocks)
        if n <= 0:
            return 0
        self.pool.resize(self._charge, (self._num_blocks + n) * self.block_bytes, reclaim=False)
        ids = self._alloc.add(n)
        if self.on_grow is not None:
            self.on_grow(ids)
        self._num_blocks += n
        return n

    def _retire_free(self, n: int, keep_floor: bool) -> int:
        # the highest free ids go, so the storage can shrink at its end
        spare = self._alloc.num_free - (self.floor_blocks if keep_floor else 0)
        if self.prefix is not None and n > spare:  # cached-free prefix blocks go too, LRU first
            spare += self.prefix.evict_blocks(n - spare)
        ids = self._alloc.retire(min(n, spare)) if spare > 0 and n > 0 else []
        if not ids:
            return 0
        self._num_blocks -= len(ids)
        self.pool.resize(self._charge, self._num_blocks * self.block_bytes)
        if self.on_retire is not None:
            self.on_retire(ids)
        return len(ids) * self.block_bytes

    def _claim(self, short: int) -> bool:
        """`short` more free blocks, now (pool lock held): up to a batch from the free bytes, and
        what those lack from other instances' free blocks (just that: they may need theirs
        soon); what is still lacking is remembered for `settle`."""
        bb = self.block_bytes
        if self.prefix is not None:
            # Unused pool bytes before cached prefixes (a cache the arbiter chose to keep is not
            # evicted while memory sits free), then this instance's cached-free blocks, LRU first.
            short -= self._add_blocks(max(short, self.claim_batch)) if short > 0 else 0
            if short > 0:
                short -= self.prefix.evict_blocks(short)
            if short <= 0:
                return True
        needed = short * bb + self.reserve_bytes
        if self._root.available_to(self._tenant) < needed:
            self._root.reclaim_kv(self._tenant, needed)
        got = self._add_blocks(max(short, self.claim_batch))
        if got < short:
            self._short = max(self._short, (short - got) * bb)
        return got >= short

    # --- layers ----------------------------------------------------------------------
    @property
    def layers(self) -> tuple[int, ...]:
        return self._layers

    def set_layers(self, layers: Iterable[int], *, keep_tables: bool = False) -> None:
        """Change the held layers (normally a contiguous range). Blocks of layers no longer held
        are freed (export them first) — unless `keep_tables`: then live sequences keep them
        (a buddy group's victims, whose KV there is still read by remote attention until it is
        exchanged; `release_layers` frees them) while new allocations cover the held layers
        only. Layers newly held start with empty tables, to be imported or recomputed."""
        layers = _layer_tuple(layers)
        with self._lock:
            for seq_id, tables in self._tables.items():
                for layer in [l for l in tables if l not in layers and not keep_tables]:
                    self._release((seq_id, layer), tables.pop(layer))
                for layer in layers:
                    tables.setdefault(layer, [])
            if self.prefix is not None:
                self.prefix.set_layers(layers)
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
        """Whether the blocks are free here now (without claiming any from the pool)."""
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int, expected_tokens: int = 0) -> bool:
        """Make every held layer's table cover `num_tokens` tokens: all or nothing.
        `expected_tokens` (e.g. prompt + max_tokens) lets chains stay contiguous as they grow.
        Too few free blocks here: claims more from the pool first."""
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed == 0:
            if seq_id not in self._tables:
                self._new_seq(seq_id)
            return True
        with self._lock:
            short = needed - self._alloc.num_free
            if short > 0 and not self._claim(short):
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

    def allocate_layers(self, seq_id: str, layers: Iterable[int], num_tokens: int) -> bool:
        """Grow one sequence's tables of `layers` (held or kept, see `set_layers`) to cover
        `num_tokens`: remote attention writing into a victim's KV of a dropped layer."""
        tables = self._tables.get(seq_id)
        if tables is None:
            raise BlockManagerError(f"sequence {seq_id} has no blocks here")
        need = cdiv(num_tokens, self.block_size)
        layers = [l for l in _layer_tuple(layers) if len(tables.setdefault(l, [])) < need]
        if not layers:
            return True
        with self._lock:
            short = sum(need - len(tables[l]) for l in layers) - self._alloc.num_free
            if short > 0 and not self._claim(short):
                return False
            for l in layers:
                table = tables[l]
                table += self._alloc.take((seq_id, l), need - len(table), table[-1] if table else None, need - len(table))
        self._refresh_covered(seq_id)
        return True

    def free(self, seq_id: str) -> int:
        """Give back all of a sequence's blocks; returns how many."""
        tables = self._tables.pop(seq_id, None)
        self._covered.pop(seq_id, None)
        if not tables:
            if self.prefix is not None:
                self.prefix.forget(seq_id)
            return 0
        n = 0
        with self._lock:
            for layer, table in tables.items():
                self._release((seq_id, layer), table)
                n += len(table)
            if self.prefix is not None:
                self.prefix.forget(seq_id)
        return n

    def _release(self, owner: Hashable, ids: list[int]) -> None:
        """Give up one table's blocks (lock held): shared prefix blocks lose a user, the rest are free."""
        self._alloc.release(owner, self.prefix.unref(ids) if self.prefix is not None else ids)

    # --- prefix caching ------------------------------------------------------------------
    def attach_prefix(self, seq: Sequence) -> tuple[int, int]:
        """Give a sequence without blocks here its leading cached prefix blocks (every held layer):
        (blocks queried, blocks hit). Its first hit * block_size tokens' KV is then in its tables."""
        if self.prefix is None or seq.seq_id in self._tables:
            return 0, 0
        with self._lock:  # match and pin at once: another thread may evict cached-free entries
            queried, hit = self.prefix.match(seq)
            if hit:
                tables = self._new_seq(seq.seq_id)
                for layer in self._layers:
                    tables[layer] = [e.blocks[layer] for e in hit]
                self.prefix.pin(seq.seq_id, hit)
                self._covered[seq.seq_id] = len(hit)
        return queried, len(hit)

    def commit_prefix(self, seq: Sequence) -> None:
        """After a step wrote its KV: name the sequence's newly full blocks in the prefix cache."""
        tables = self._tables.get(seq.seq_id)
        if self.prefix is not None and tables is not None:
            self.prefix.commit(seq, tables)

    def _new_seq(self, seq_id: str) -> dict[int, list[int]]:
        tables: dict[int, list[int]] = {layer: [] for layer in self._layers}
        self._tables[seq_id] = tables
        self._covered[seq_id] = 0
        return tables

    def _refresh_covered(self, seq_id: str) -> None:
        tables = self._tables[seq_id]
        self._covered[seq_id] = min((len(tables[l]) for l in self._layers), default=0)

    def stats(self) -> dict[str, int]:
        return {
            "num_blocks": self._num_blocks,
            "used_blocks": self.num_used_blocks,
            "free_blocks": self.num_free_blocks,
            "block_size": self.block_size,
            "kv_bytes": self._num_blocks * self.block_bytes,
            "capacity_blocks": self.capacity_blocks,
            "kv_used_bytes": self.num_used_blocks * self.block_bytes,
            "num_layers": len(self._layers),
            "cached_blocks": self.num_cached_blocks,
        }

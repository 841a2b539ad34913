"""Automatic prefix caching on the paged KV (vLLM's scheme): full blocks named by a chained hash,
shared between sequences by reference count, kept after their last user in an LRU pool. No torch.

An *entry* is one full token block of one sequence: the per-layer block ids of the held layers
(a block in block_manager.py is one layer's KV for `block_size` tokens) named by
`shared.prefix_hash.block_hashes(tokens, block_size, prefix_salt(model, adapter))`: equal names
mean equal tokens 0..(i+1)*block_size under the same weights, hence equal KV. Its `refs` counts
the (sequence, layer) table slots pointing at its blocks, so a sequence that releases one layer
(buddy groups) drops exactly its share.

* Registration: once a sequence's block is fully computed (its KV is never written again:
  attention writes only the slots of new tokens), `commit` names it; a name already held
  stops that sequence's registration (its own copy stays private, freed as usual).
* Hits: a new sequence is given the leading entries matching its tokens, at most
  `(num_tokens - 1) // block_size` of them, so the last token is always computed (it must
  be, to sample) — a sequence never writes into a shared block, which is what makes the
  sharing safe without copy-on-write.
* Free: an entry whose refs reach 0 is *cached-free*: its blocks stay out of the allocator,
  in LRU order (a freed sequence's tail blocks are older than its head), until a hit pins it
  again or the block manager needs blocks (`evict_blocks`: its own allocations and the
  pool's reclaim both take cached-free blocks before refusing).
* Validity: an entry holds the layers held when it was made. Any change of the held layers
  (a buddy group forms or collapses) makes every entry stale — never hit, freed with its last
  user — and the cache stays off while the instance holds a different layer set than it was
  built with: layer-subset instances do not share. An adapter removed or re-registered makes
  its entries stale the same way (`invalidate`).

Thread-safety: every method takes the pool's re-entrant lock, the lock the block manager
holds while it touches free blocks; `held_hashes`, `hit_stats`, `cached_free_blocks` and
`evict` may be called from any thread.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.prefix_hash import block_hash, prefix_salt, ROOT_HASH

if TYPE_CHECKING:
    from services.gpu_worker.engine.sequence import Sequence


@dataclass(slots=True, eq=False)
class _Entry:
    hash: int
    blocks: dict[int, int]  # layer -> block id
    adapter: str | None
    refs: int = 0  # (sequence, layer) table slots pointing at these blocks
    stale: bool = False


@dataclass(slots=True)
class _SeqState:
    hashes: list[int] = field(default_factory=list)  # names of its full blocks so far, in order
    adapter: str | None = None
    done: int = 0  # leading blocks attached from the cache or registered (registration goes on from here)
    stopped: bool = False  # a name it computed was already held: it registers no more


class PrefixCache:
    def __init__(self, *, block_size: int, model: str, layers: tuple[int, ...], lock: threading.RLock,
                 release: Callable[[list[int]], None]) -> None:
        self.block_size = block_size
        self.model = model
        self._lock = lock
        self._release = release  # hand block ids back to the allocator (lock held)
        self._built_layers = layers
        self.layers = layers
        self._index: OrderedDict[int, _Entry] = OrderedDict()  # valid entries, least recently used first
        self._free: OrderedDict[int, _Entry] = OrderedDict()  # valid entries with refs == 0, LRU first
        self._owner: dict[int, _Entry] = {}  # block id -> its entry (valid or stale)
        self._seqs: dict[str, _SeqState] = {}
        self._free_blocks = 0  # per-layer blocks held by cached-free entries
        self._queried = 0
        self._hits = 0

    @property
    def enabled(self) -> bool:
        return self.layers == self._built_layers

    # --- the agreed interface (any thread) ------------------------------------------------
    def held_hashes(self) -> list[int]:
        """Names of the full blocks held (in use or cached-free), most recently used first."""
        with self._lock:
            return list(reversed(self._index))

    def hit_stats(self) -> tuple[int, int]:
        """(queried blocks, hit blocks), cumulative over admitted requests."""
        with self._lock:
            return self._queried, self._hits

    def cached_free_blocks(self) -> int:
        """Entries (token blocks, every held layer) held only by the cache: evictable."""
        with self._lock:
            return len(self._free)

    @property
    def cached_free_kv_blocks(self) -> int:
        """The same in the block manager's unit (one layer's block): what evicting them all frees."""
        return self._free_blocks

    def evict(self, n: int) -> int:
        """Evict up to n cached-free entries, least recently used first; how many were evicted.
        Their blocks become free blocks of the block manager (the pool takes them from there)."""
        with self._lock:
            done = 0
            while done < n and self._free:
                self._drop(self._free.popitem(last=False)[1])
                done += 1
            return done

    # --- the block manager's side (lock held by the caller or taken here) -------------------
    def evict_blocks(self, n: int) -> int:
        """Evict LRU cached-free entries until at least n per-layer blocks are freed (or none is
        left); how many blocks were freed."""
        with self._lock:
            got = 0
            while got < n and self._free:
                got += self._drop(self._free.popitem(last=False)[1])
            return got

    def _drop(self, entry: _Entry) -> int:
        """Forget a cached-free entry and give its blocks to the allocator."""
        if self._index.get(entry.hash) is entry:
            del self._index[entry.hash]
        ids = list(entry.blocks.values())
        if not entry.stale:
            self._free_blocks -= len(ids)
        for b in ids:
            del self._owner[b]
        self._release(ids)
        return len(ids)

    def hashes(self, seq: Sequence, n: int) -> list[int]:
        """The names of seq's first n full blocks (computed once per sequence, kept while it lives)."""
        st = self._seqs.get(seq.seq_id)
        if st is None or st.adapter != seq.adapter:
            st = self._seqs[seq.seq_id] = _SeqState(adapter=seq.adapter)
        bs, have = self.block_size, st.hashes
        if len(have) < n:
            salt = prefix_salt(self.model, seq.adapter)
            parent = have[-1] if have else ROOT_HASH
            for i in range(len(have), n):
                parent = block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs), salt)
                have.append(parent)
        return have[:n]

    def match(self, seq: Sequence) -> tuple[int, list[_Entry]]:
        """(blocks queried, leading cached entries) for a sequence with no KV yet."""
        if not self.enabled:
            return 0, []
        limit = (seq.num_tokens - 1) // self.block_size
        names = self.hashes(seq, limit)
        with self._lock:
            hit: list[_Entry] = []
            for h in names:
                entry = self._index.get(h)
                if entry is None:
                    break
                hit.append(entry)
            return limit, hit

    def pin(self, seq_id: str, entries: list[_Entry]) -> None:
        """seq_id's tables now hold `entries`' blocks on every held layer (lock held)."""
        slots = len(self.layers)
        for e in entries:
            if e.refs == 0:
                del self._free[e.hash]
                self._free_blocks -= len(e.blocks)
            e.refs += slots
            self._index.move_to_end(e.hash)
        st = self._seqs.setdefault(seq_id, _SeqState())
        st.done = len(entries)

    def record(self, queried: int, hits: int) -> None:
        with self._lock:
            self._queried += queried
            self._hits += hits

    def commit(self, seq: Sequence, tables: dict[int, list[int]]) -> None:
        """Name seq's blocks computed since the last call (after a step wrote their KV)."""
        st = self._seqs.get(seq.seq_id)
        full = seq.num_computed_tokens // self.block_size
        if st is None:
            st = self._seqs[seq.seq_id] = _SeqState(adapter=seq.adapter)
        if st.stopped or st.done >= full or not self.enabled:
            return
        if any(len(tables.get(layer, ())) < full for layer in self.layers):
            return  # not every held layer has its blocks (a migration's tables): name nothing
        names = self.hashes(seq, full)
        with self._lock:
            for i in range(st.done, full):
                if names[i] in self._index:
                    st.stopped = True
                    return
                blocks = {layer: tables[layer][i] for layer in self.layers}
                entry = _Entry(names[i], blocks, seq.adapter, refs=len(blocks))
                self._index[names[i]] = entry
                for b in blocks.values():
                    self._owner[b] = entry
                st.done = i + 1

    def unref(self, ids: Iterable[int]) -> list[int]:
        """Drop one table's references (lock held): the ids that were private, for the allocator.
        Entries left without users become cached-free (the table's tail first, so it is older)."""
        private: list[int] = []
        for b in reversed(list(ids)):
            entry = self._owner.get(b)
            if entry is None:
                private.append(b)
                continue
            entry.refs -= 1
            if entry.refs < 0:
                raise RuntimeError(f"prefix cache: block {b} released more often than held")
            if entry.refs == 0:
                if entry.stale:
                    self._drop(entry)
                else:
                    self._free[entry.hash] = entry
                    self._free_blocks += len(entry.blocks)
        private.reverse()
        return private

    def forget(self, seq_id: str) -> None:
        """The sequence holds no blocks any more (freed, preempted): it starts over next time."""
        self._seqs.pop(seq_id, None)

    # --- validity --------------------------------------------------------------------------
    def set_layers(self, layers: tuple[int, ...]) -> None:
        """The held layers changed: every entry goes stale; off unless back to the built set."""
        with self._lock:
            if layers != self.layers:
                self.invalidate()  # live sequences stop naming blocks: theirs were made under the old layers
                self.layers = layers

    def invalidate(self, adapter: str | None = None, *, everything: bool = True) -> int:
        """Make entries stale (all, or those of `adapter` when everything is False): never hit
        again, their blocks freed with their last user (now, for cached-free ones). Returns how many."""
        with self._lock:
            doomed = [e for e in self._index.values() if everything or e.adapter == adapter]
            for e in doomed:
                del self._index[e.hash]
                if e.refs == 0:
                    del self._free[e.hash]
                    self._free_blocks -= len(e.blocks)
                    e.stale = True
                    self._drop(e)
                else:
                    e.stale = True
            for st in self._seqs.values():  # names chained on stale blocks must not be registered later
                if everything or st.adapter == adapter:
                    st.stopped = True
            return len(doomed)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"prefix_entries": len(self._index), "prefix_cached_free": len(self._free),
                    "prefix_cached_free_blocks": self._free_blocks, "prefix_queried_blocks": self._queried,
                    "prefix_hit_blocks": self._hits}

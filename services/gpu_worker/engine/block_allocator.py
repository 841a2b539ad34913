"""Free KV block ids, handed out so that each (sequence, layer) chain stays contiguous when it can.

Paging lets any free block serve any chain, but a chain whose blocks are consecutive ids
is one contiguous stretch of the KV storage, which attention can read in place instead
of gathering it (the big cost of decode on CPU). So: a chain grows into the block right
after its last one when that is free; a new chain (or piece) starts at the first run of
open blocks long enough for what the chain expects to need (prompt + max_tokens), and
the rest of that run is softly reserved for it. Reservations never reduce capacity: a
reserved block is free, and is handed to anyone once no open run is left.
"""
from __future__ import annotations

from collections.abc import Hashable

_FREE = b"\x01"


class BlockAllocator:
    def __init__(self) -> None:
        self._free = bytearray()  # 1: block b is free
        self._open = bytearray()  # 1: free and not inside a reservation
        self._retired: set[int] = set()  # ids below the limit that are not blocks now
        self._reservations: dict[Hashable, tuple[int, int]] = {}  # owner -> reserved [start, end)
        self.num_free = 0

    @property
    def limit(self) -> int:
        return len(self._free)

    # --- capacity --------------------------------------------------------------------
    def add(self, n: int) -> list[int]:
        """n more blocks: retired ids first (lowest first), then fresh ids at the end; returns their ids."""
        ids = sorted(self._retired)[:n]
        for b in ids:
            self._retired.discard(b)
            self._free[b] = self._open[b] = 1
        self.num_free += len(ids)
        n -= len(ids)
        if n > 0:
            ids.extend(range(len(self._free), len(self._free) + n))
            self._free.extend(_FREE * n)
            self._open.extend(_FREE * n)
            self.num_free += n
        return ids

    def retire(self, n: int) -> list[int]:
        """Stop using up to n free blocks, highest ids first; returns their ids."""
        done: list[int] = []
        pos = len(self._free)
        while len(done) < n:
            b = self._free.rfind(_FREE, 0, pos)
            if b < 0:
                break
            self._free[b] = self._open[b] = 0
            self._retired.add(b)
            pos = b
            done.append(b)
        self.num_free -= len(done)
        while self._free and len(self._free) - 1 in self._retired:  # shrink the id space at its end
            self._retired.discard(len(self._free) - 1)
            del self._free[-1]
            del self._open[-1]
        return done

    # --- chains ----------------------------------------------------------------------
    def take(self, owner: Hashable, n: int, last: int | None, expect: int) -> list[int]:
        """n blocks for `owner`'s chain ending at block `last` (None: a new chain), which
        expects to need `expect` >= n more blocks in all. Caller checks num_free >= n."""
        if n > self.num_free:
            raise RuntimeError(f"take({n}) with {self.num_free} free blocks")
        out: list[int] = []
        b = -1 if last is None else last + 1
        while b >= 0 and len(out) < n and b < len(self._free) and self._free[b]:
            out.append(b)  # grow in place (into our reservation, or open space)
            b += 1
        self._mark_used(out)
        if len(out) < n:
            out += self._place(owner, n - len(out), max(n, expect) - len(out))
        return out

    def _place(self, owner: Hashable, n: int, want: int) -> list[int]:
        # The longest run we can get, down to exactly n: first among open blocks, then
        # eating into other chains' reservations, and only then scattered blocks.
        for space, reserve in ((self._open, True), (self._free, False)):
            ask = want
            while True:
                s = space.find(_FREE * ask)
                if s >= 0:
                    self._release_reservation(owner)
                    ids = list(range(s, s + n))
                    self._mark_used(ids)
                    if ask > n and reserve:
                        self._open[s + n : s + ask] = bytes(ask - n)
                        self._reservations[owner] = (s + n, s + ask)
                    return ids
                if ask == n:
                    break
                ask = max(n, ask // 2)
        ids, pos = [], 0
        while len(ids) < n:
            pos = self._free.find(_FREE, pos)
            ids.append(pos)
            pos += 1
        self._mark_used(ids)
        return ids

    def _mark_used(self, ids: list[int]) -> None:
        for b in ids:
            self._free[b] = self._open[b] = 0
        self.num_free -= len(ids)

    def release(self, owner: Hashable | None, ids: list[int]) -> None:
        """Free blocks (of `owner`'s chain); the owner's reservation opens again."""
        for b in ids:
            self._free[b] = self._open[b] = 1
        self.num_free += len(ids)
        if owner is not None:
            self._release_reservation(owner)

    def _release_reservation(self, owner: Hashable) -> None:
        span = self._reservations.pop(owner, None)
        if span is not None:
            start, end = span
            for b in range(start, min(end, len(self._free))):  # retire() may have cut the span
                if self._free[b]:
                    self._open[b] = 1

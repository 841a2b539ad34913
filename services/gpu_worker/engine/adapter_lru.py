"""One residency level of LoRA adapters (device or host): LRU order, sizes, pins, a bound.

Pure bookkeeping (no torch, no I/O): `LoRAManager` keeps one for the device copies and one
for the host repository and asks them which adapter to drop. A pinned adapter is never a
victim (`pinned: true` on load: a customer's adapter kept warm whatever the traffic); when
only pinned or in-use adapters are left, there is no victim and the caller reports no room.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator


class AdapterLRU:
    def __init__(self, limit_bytes: int | None = None) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes  # None: unbounded (the device level is bounded by the pool instead)
        self._order: OrderedDict[str, int] = OrderedDict()  # least recently used first -> bytes
        self.pinned: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self._order

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    @property
    def bytes(self) -> int:
        return sum(self._order.values())

    def size(self, name: str) -> int:
        return self._order[name]

    def add(self, name: str, nbytes: int) -> None:
        """Hold `name` (most recently used)."""
        self._order[name] = nbytes
        self._order.move_to_end(name)

    def touch(self, name: str) -> None:
        self._order.move_to_end(name)

    def remove(self, name: str) -> None:
        self._order.pop(name, None)
        self.pinned.discard(name)

    def pin(self, name: str) -> None:
        if name not in self._order:
            raise KeyError(f"adapter {name!r} is not held at this level")
        self.pinned.add(name)

    def unpin(self, name: str) -> None:
        self.pinned.discard(name)

    def victim(self, keep: Collection[str] = ()) -> str | None:
        """The least recently used adapter that is neither pinned nor in `keep`."""
        return next((n for n in self._order if n not in self.pinned and n not in keep), None)

    def evictable_bytes(self, keep: Collection[str] = ()) -> int:
        return sum(b for n, b in self._order.items() if n not in self.pinned and n not in keep)

    def over_limit(self, extra: int = 0) -> bool:
        return self.limit_bytes is not None and self.bytes + extra > self.limit_bytes

    def victims_for(self, nbytes: int, keep: Collection[str] = ()) -> list[str] | None:
        """Adapters to drop, oldest first, so that `nbytes` more fit under the limit; None if even
        dropping every unpinned one not in `keep` is not enough."""
        if self.limit_bytes is None:
            return []
        if nbytes > self.limit_bytes:
            return None
        out, held = [], self.bytes
        for name, size in self._order.items():
            if held + nbytes <= self.limit_bytes:
                break
            if name in self.pinned or name in keep:
                continue
            out.append(name)
            held -= size
        return out if held + nbytes <= self.limit_bytes else None


__all__ = ["AdapterLRU"]

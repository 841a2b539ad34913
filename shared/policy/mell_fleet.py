"""MELL's per-device bookkeeping: items, devices, and the per-category activation index.

An *item* is the unit MELL packs: one request (L/M/S/T) or a multi-item ("bundle") of tiny
requests, which packs as a T item. A device's *category* is the class of its largest item
(§VI-C). `Fleet` keeps, per category, the active devices sorted by activation sequence, so
"the most recently activated X-GPU" is the last entry of a list and a rule that looks at
"every L-GPU" scans only the L-GPUs, never the whole fleet.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from shared.policy.mell_classes import RANK

CATEGORIES = ("L", "M", "S", "T")


class Item:
    __slots__ = ("key", "size", "cls", "members", "device")

    def __init__(self, key: str, size: int, cls: str, members: dict[str, int] | None = None) -> None:
        self.key = key
        self.size = size
        self.cls = cls  # "L" | "M" | "S" | "T" (a bundle is "T")
        self.members = members  # request_id -> size, for a bundle of tiny requests; None for one request
        self.device: Device | None = None

    @property
    def cost(self) -> int:
        """Migrating this item migrates this many requests."""
        return 1 if self.members is None else len(self.members)

    def request_ids(self) -> list[str]:
        return [self.key] if self.members is None else list(self.members)


class Device:
    __slots__ = ("id", "seq", "used", "items", "n_requests", "counts", "capacity", "pinned")

    def __init__(self, device_id: str, seq: int, capacity: int) -> None:
        self.id = device_id
        self.seq = seq  # activation order: larger = more recently activated
        self.capacity = capacity
        self.used = 0
        self.pinned = 0  # bytes the device physically holds beyond MELL's books (an outgoing copy not yet handed over)
        self.items: dict[str, Item] = {}
        self.n_requests = 0
        self.counts = {"L": 0, "M": 0, "S": 0, "T": 0}

    @property
    def free(self) -> int:
        """Room for placing a request here: what neither MELL's books nor a pinned copy hold."""
        return self.capacity - self.used - self.pinned

    @property
    def room(self) -> int:
        """Room for the growth of the requests already here (a pinned copy is handed over within seconds;
        meanwhile the engine holds the growth back, it does not make MELL move requests)."""
        return self.capacity - self.used

    @property
    def category(self) -> str | None:
        for cls in CATEGORIES:
            if self.counts[cls]:
                return cls
        return None

    def items_of(self, *classes: str) -> list[Item]:
        return [it for it in self.items.values() if it.cls in classes]

    def large(self) -> Item | None:
        if not self.counts["L"]:
            return None
        return next(it for it in self.items.values() if it.cls == "L")

    def priority_key(self) -> tuple[int, int, int]:
        """Workload priority (smaller sorts first): fewer requests, then more free memory, then
        the more recently activated."""
        return (self.n_requests, -self.free, -self.seq)


class Fleet:
    """Active devices, indexed by category and activation order; activation and retirement."""

    def __init__(self, capacity: int, device_ids: Sequence[str] | None) -> None:
        self.capacity = capacity
        self.active: dict[str, Device] = {}
        self._pool: list[str] | None = None if device_ids is None else list(device_ids)
        self._pool_rank = {} if device_ids is None else {d: i for i, d in enumerate(device_ids)}
        self._idle: list[int] = list(range(len(self._pool or ())))  # pool ranks not active, as a heap-free sorted list
        self._minted = 0
        self._seq = 0
        self._by_cat: dict[str, list[int]] = {c: [] for c in CATEGORIES}
        self._by_seq: dict[int, Device] = {}
        self.retired: dict[str, Device] = {}  # devices retired since the caller last cleared this (a batch)

    # ---- activation -------------------------------------------------------------------
    def has_spare(self) -> bool:
        return self._pool is None or bool(self._idle)

    def next_spare(self) -> str | None:
        """The id `activate` would use from the device list, without activating (None: no list, or
        none idle)."""
        return self._pool[self._idle[0]] if self._pool is not None and self._idle else None

    def activate(self) -> Device | None:
        """A fresh empty device (the first idle one of the pool, or a minted id), or None."""
        if self._pool is None:
            device_id = f"gpu-{self._minted}"
            self._minted += 1
        elif self._idle:
            device_id = self._pool[self._idle.pop(0)]
        else:
            return None
        self._seq += 1
        dev = Device(device_id, self._seq, self.capacity)
        self.active[device_id] = dev
        return dev

    def retire(self, dev: Device) -> None:
        assert not dev.items, f"retiring non-empty device {dev.id}"
        del self.active[dev.id]
        self.retired[dev.id] = dev
        if self._pool is not None:
            bisect.insort(self._idle, self._pool_rank[dev.id])

    def revive(self, dev: Device) -> None:
        """A device retired in this batch taken back, as if freshly activated (batching's swaps)."""
        assert dev.id not in self.active and not dev.items, f"reviving {dev.id}"
        if self._pool is not None:
            self._idle.remove(self._pool_rank[dev.id])
        self._seq += 1
        dev.seq = self._seq
        dev.pinned = 0
        self.active[dev.id] = dev
        self.retired.pop(dev.id, None)

    def reactivate(self, dev: Device) -> None:
        """An empty device taken again as if freshly activated (it becomes the most recent)."""
        cat = dev.category
        if cat is not None:
            self._unindex(dev, cat)
        self._seq += 1
        dev.seq = self._seq
        if cat is not None:
            self._index(dev, cat)

    # ---- the category index -----------------------------------------------------------
    def _index(self, dev: Device, cat: str) -> None:
        bisect.insort(self._by_cat[cat], dev.seq)
        self._by_seq[dev.seq] = dev

    def _unindex(self, dev: Device, cat: str) -> None:
        seqs = self._by_cat[cat]
        del seqs[bisect.bisect_left(seqs, dev.seq)]
        del self._by_seq[dev.seq]

    def latest(self, cat: str, exclude: Device | None = None) -> Device | None:
        """The most recently activated device of category `cat` (other than `exclude`)."""
        seqs = self._by_cat[cat]
        for seq in reversed(seqs[-2:]):
            dev = self._by_seq[seq]
            if dev is not exclude:
                return dev
        return None

    def of_category(self, cat: str) -> Iterator[Device]:
        by_seq = self._by_seq
        return (by_seq[s] for s in list(self._by_cat[cat]))

    def count(self, cat: str) -> int:
        return len(self._by_cat[cat])

    # ---- item bookkeeping (keeps the index in step with each device's category) ----------
    def add(self, dev: Device, item: Item) -> None:
        before = dev.category
        dev.items[item.key] = item
        dev.used += item.size
        dev.n_requests += item.cost
        dev.counts[item.cls] += 1
        item.device = dev
        self._recategorise(dev, before)

    def remove(self, item: Item) -> Device:
        dev = item.device
        assert dev is not None
        before = dev.category
        del dev.items[item.key]
        dev.used -= item.size
        dev.n_requests -= item.cost
        dev.counts[item.cls] -= 1
        item.device = None
        self._recategorise(dev, before)
        return dev

    def resize(self, item: Item, size: int, cls: str, cost_delta: int = 0) -> None:
        """Change an item's size (and class) where it lies."""
        dev = item.device
        assert dev is not None
        before = dev.category
        dev.used += size - item.size
        dev.n_requests += cost_delta
        dev.counts[item.cls] -= 1
        dev.counts[cls] += 1
        item.size, item.cls = size, cls
        self._recategorise(dev, before)

    def _recategorise(self, dev: Device, before: str | None) -> None:
        after = dev.category
        if after != before:
            if before is not None:
                self._unindex(dev, before)
            if after is not None:
                self._index(dev, after)


def demoted(before: str | None, after: str | None) -> bool:
    """True when a non-empty device's largest class fell (e.g. an L-GPU left with M/T items)."""
    return before is not None and after is not None and RANK[after] < RANK[before]

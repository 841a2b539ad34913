"""Placing a new item, tiny-request bundles, and Fig. 10 Update (the rest of MellScheduler).

The choices made here are listed in the docstring of `shared.policy.mell`.
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.mell_classes import RANK
from shared.policy.mell_fleet import Device, Item
from shared.policy.mell_ops import Move, NoCapacity
from shared.policy.mell_rules import NEW, MellRules


class MellPlacement(MellRules):
    def __init__(self, capacity: int, devices: Sequence[str] | None, max_migrations_per_op: int,
                 bundle_members: int | None = None) -> None:
        super().__init__(capacity, devices, max_migrations_per_op)
        self._item_of: dict[str, Item] = {}  # request_id -> its item (itself, or its bundle)
        self._filling: Item | None = None  # the bundle that tiny requests join
        self._bundles = 0
        # a bundle moves as all its requests: keep it small enough that two fit one op's cap
        self._bundle_members = max(1, max_migrations_per_op // 2) if bundle_members is None else bundle_members
        if self._bundle_members < 1:
            raise ValueError(f"bundle_members must be >= 1, got {bundle_members}")

    def _destination(self, item: Item, reuse: Device | None, reserve: int) -> Device:
        """Where a not-yet-placed item goes, its way cleared; `reuse`: an emptied device that
        stands in for a new one. Raises NoCapacity before changing anything."""
        choice, plan = self._choose(item, None, True, reserve)
        if choice == NEW:
            if reuse is not None and self._alive(reuse) and not reuse.items:
                self.fleet.reactivate(reuse)
                return reuse
            dest = self.fleet.activate() or self._best_fit(item.size, None)
            if dest is None:
                raise NoCapacity(f"request {item.request_ids()[0]!r} of size {item.size} fits on no device: "
                                 f"all {len(self.fleet.active)} devices are active and none has "
                                 f"{item.size} units free (C={self.capacity})")
            return dest
        assert isinstance(choice, Device)
        if self._clear_evictions(plan, choice) and choice.free >= item.size:
            return choice
        dest = self.fleet.activate() or self._best_fit(item.size, None)
        if dest is None:
            raise NoCapacity(f"request {item.request_ids()[0]!r} of size {item.size} fits on no device")
        return dest

    def _place(self, item: Item, reuse: Device | None, reserve: int = 0) -> Device:
        dest = self._destination(item, reuse, reserve)
        self.fleet.add(dest, item)
        if item.cls in ("L", "M"):
            self._top_up(dest)
        return dest

    def _peek_destination(self, size: int, cls: str) -> str | None:
        """The device `_destination` would give a new item of `size`/`cls` in a fresh operation, without
        changing anything: `_choose` only reads (its budget and cap flag are restored). Clearing evictions
        is assumed to succeed (`_evict_plan` only plans them when a spare device is left); the rare miss,
        and a pending refill retried at the operation's end that pulls the new item elsewhere, make a
        hint wrong, which costs one migration, not correctness."""
        saved = self._budget, self._capped
        self._budget = self.max_migrations_per_op  # as at the start of the operation
        try:
            choice, _ = self._choose(Item("peek", size, cls), None, True, 0)
        finally:
            self._budget, self._capped = saved
        if isinstance(choice, Device):
            return choice.id
        spare = self.fleet.next_spare()
        if spare is not None or self.fleet.has_spare():
            return spare  # an idle device of the list, or None: a device minted on activation
        fallback = self._best_fit(size, None)
        return None if fallback is None else fallback.id

    def _bundle_with_room(self, size: int) -> Item | None:
        """The filling bundle, when a tiny request of `size` joins it (else a new bundle opens)."""
        b = self._filling
        if (b is not None and b.device is not None and 4 * (b.size + size) <= self.capacity
                and b.device.free >= size and b.cost < self._bundle_members):
            return b
        return None

    def _join_bundle(self, request_id: str, size: int, reuse: Device | None = None) -> Device:
        b = self._bundle_with_room(size)
        if b is not None:
            assert b.members is not None
            b.members[request_id] = size
            self.fleet.resize(b, b.size + size, "T", cost_delta=1)
        else:
            self._bundles += 1
            b = Item(f"bundle:{self._bundles}", size, "T", {request_id: size})
            self._place(b, reuse=reuse)
            self._filling = b
        self._item_of[request_id] = b
        assert b.device is not None
        return b.device

    def _update_single(self, item: Item, size: int, cls: str) -> None:
        dev = item.device
        assert dev is not None
        delta = size - item.size
        old_cls = item.cls
        stays = cls == old_cls or (old_cls == "M" and cls == "L" and dev.category == "M")
        if stays and delta <= dev.room:
            self.fleet.resize(item, size, cls)
            if delta < 0 or cls != old_cls:
                self._top_up(dev)
            return
        if stays and all(RANK[o.cls] < RANK[cls] for o in dev.items.values() if o is not item):
            others = sorted((o for o in dev.items.values() if o is not item), key=lambda o: (RANK[o.cls], -o.size))
            plan, freed = [], dev.room
            for o in others:
                if freed >= delta:
                    break
                plan.append(o)
                freed += o.size
            for o in plan[:-1]:  # keep only what is needed once the larger ones go
                if freed - o.size >= delta:
                    plan.remove(o)
                    freed -= o.size
            if freed >= delta and self.fleet.has_spare() and sum(o.cost for o in plan) <= self._budget:
                # T items first, then (last) at most one M/S-request, which may itself clear T items
                # off an L-GPU (property 4) with what budget is left
                touched = [o for o in plan if self._relocate(o, allow_evict=o is plan[-1], follow=False)]
                if delta <= dev.room:  # else a device ran out mid-way: the request itself moves
                    self.fleet.resize(item, size, cls)
                    self._top_up(dev)
                    for o in touched:
                        if o.device is not None:
                            self._top_up(o.device)
                    return
        self._move_grown(item, dev, size, cls)

    def _move_grown(self, item: Item, dev: Device, size: int, cls: str) -> None:
        """Depart the request and re-allocate it at its new size (one migration)."""
        before, old = dev.category, (item.size, item.cls)
        self.fleet.remove(item)
        item.size, item.cls = size, cls
        try:
            dest = self._destination(item, reuse=dev, reserve=1)
        except NoCapacity:
            item.size, item.cls = old
            self.fleet.add(dev, item)
            raise
        self.fleet.add(dest, item)
        if dest is not dev:
            self._record(item, dev, dest)
            self._settle(dev, before)
        if cls in ("L", "M") or dest is dev:
            self._top_up(dest)

    def _update_tiny(self, bundle: Item, request_id: str, size: int, cls: str) -> None:
        assert bundle.members is not None
        dev = bundle.device
        assert dev is not None
        old = bundle.members[request_id]
        delta = size - old
        if cls == "tiny" and 4 * (bundle.size + delta) <= self.capacity and delta <= dev.room:
            bundle.members[request_id] = size
            self.fleet.resize(bundle, bundle.size + delta, "T")
            if delta < 0:
                self._top_up(dev)
            return
        if cls in ("tiny", "T") and delta <= dev.room:
            self._split_in_place(bundle, request_id, size, cls)  # Fig. 10 Update has no rule for it: it stays
            return
        # the request leaves its bundle: one migration unless it lands on the same device
        before = dev.category
        if len(bundle.members) > 1:
            del bundle.members[request_id]
            self.fleet.resize(bundle, bundle.size - old, "T", cost_delta=-1)
        else:
            if bundle is self._filling:
                self._filling = None
            self.fleet.remove(bundle)  # while it still counts its last request (its cost), then empty it
            del bundle.members[request_id]
        try:
            if cls == "tiny":
                dest = self._join_bundle(request_id, size, reuse=dev)
            else:
                item = Item(request_id, size, cls)
                dest = self._place(item, reuse=dev, reserve=1)
                self._item_of[request_id] = item
        except NoCapacity:
            bundle.members[request_id] = old
            if bundle.device is None:
                self.fleet.add(dev, bundle)
            else:
                self.fleet.resize(bundle, bundle.size + old, "T", cost_delta=1)
            raise
        if dest is not dev:
            self._budget -= 1
            self._op_items += 1
            self._moves.append(Move(request_id, dev.id, dest.id))
            self._settle(dev, before)

    def _split_in_place(self, bundle: Item, request_id: str, size: int, cls: str) -> None:
        """A tiny request that grew into T, or whose bundle would pass C/4, leaves its bundle where it is:
        as a T item, or as a multi-item of its own (Fig. 10 prescribes no move for it)."""
        assert bundle.members is not None and bundle.device is not None
        dev = bundle.device
        old = bundle.members[request_id]
        if len(bundle.members) > 1:
            del bundle.members[request_id]
            self.fleet.resize(bundle, bundle.size - old, "T", cost_delta=-1)
        else:
            if bundle is self._filling:
                self._filling = None
            self.fleet.remove(bundle)
        if cls == "T":
            item = Item(request_id, size, "T")
        else:
            self._bundles += 1
            item = Item(f"bundle:{self._bundles}", size, "T", {request_id: size})
        self.fleet.add(dev, item)
        self._item_of[request_id] = item

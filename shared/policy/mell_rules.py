"""The Fig. 10 rules of MELL's online scheduler, on a `Fleet` (the building blocks of mell.py).

Where an item goes (`_choose`), after Fig. 10 Allocate:
  * L: a newly activated device.
  * M/S: the L-GPU with no M/S-request whose L-request leaves room (S_L + S_i <= C) with the
    highest workload priority (fewer requests, then more free memory); T items on it are moved
    off as needed (the paper re-allocates all of them; moving only those in the way is cheaper
    and keeps the same properties). Otherwise the most recently activated GPU of the request's
    own class (M-GPU for M, S-GPU for S: mixing them would break Theorem 1 properties 1-2) if it
    holds fewer than 2 M / 3 S; otherwise a new device.
  * T (and bundles of tiny requests): the L-GPU or full M-GPU (two M) with room and the highest
    priority -- M-GPUs too, because properties 1 and 5 ("M-GPU: two M, possibly one T"; "T-GPUs
    only if every L/M-GPU is >= 75% used") require it; otherwise the most recently activated
    T-GPU if it has room; otherwise a new device.
After a device loses an item (`_settle`, Fig. 10 Depart): an emptied device is retired
(Algorithm 1); a device whose largest class fell (its L left) has its other items re-allocated
(rule 4); otherwise `_top_up` refills it: an L-GPU without M/S pulls the fitting M/S-request
from the M/S-GPU with the highest priority (which is then refilled from the most recently
activated GPU of that class), an M/S-GPU that is not the most recent of its class pulls one
from the most recent, and an L-GPU, full M-GPU or non-latest T-GPU under 75% pulls T items from
the most recently activated T-GPU. "Most recently activated" is per category, so the only
GPUs exempt from Theorem 1 are the latest M-, S- and T-GPU.

The migration cap: every move spends `item.cost` (requests moved) from the operation's budget.
Moves that only improve packing (refills, pulls, re-allocating a departed L's companions) are
skipped when the budget cannot pay for them; the operation is then counted in
`capped_operations`, the skipped repair shows in `theorem1_violations()`, and the device's
refill is retried at the end of later operations with whatever budget they leave unused. Moves that keep a device within capacity (Eq. 2) are
planned first and never skipped: when moving the others would cost too much, the grown request
itself moves (one migration).
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.mell_classes import FULL_COUNT, RANK, at_least_three_quarters
from shared.policy.mell_fleet import Device, Fleet, Item, demoted
from shared.policy.mell_ops import Move

NEW = "new"  # _choose's answer: activate a device


class MellRules:
    def __init__(self, capacity: int, devices: Sequence[str] | None, max_migrations_per_op: int) -> None:
        if max_migrations_per_op < 1:
            raise ValueError(f"max_migrations_per_op must be >= 1, got {max_migrations_per_op}")
        self.capacity = capacity
        self.fleet = Fleet(capacity, devices)
        self.max_migrations_per_op = max_migrations_per_op
        self.capped_operations = 0  # operations that stopped moving at the cap
        self._budget = max_migrations_per_op
        self._moves: list[Move] = []
        self._capped = False
        self._pending: dict[str, Device] = {}  # devices whose refill the cap cut short
        self._one_refill = False  # Fig. 10 Depart: one T-request moved in per departure (not "until 75%")
        self._defer: dict[str, Device] | None = None  # batching: refills held until the batch's arrivals are placed
        self._op_items = 0  # items (a multi-item counts once, as Theorem 3 does) moved in this operation
        self.last_op_items = 0  # ... in the last operation that ended

    # ---- operation frame ----------------------------------------------------------------
    def _begin_op(self) -> None:
        self._budget = self.max_migrations_per_op
        self._moves = []
        self._capped = False
        self._op_items = 0

    def _end_op(self) -> tuple[Move, ...]:
        capped = self._capped
        if self._pending and self._budget > 0:  # retry refills cut short earlier, with what is left
            for dev in list(self._pending.values()):
                del self._pending[dev.id]
                if self._alive(dev):
                    self._top_up(dev)
        if capped:
            self.capped_operations += 1
        self.last_op_items = self._op_items
        return tuple(self._moves)

    def _alive(self, dev: Device) -> bool:
        return self.fleet.active.get(dev.id) is dev

    def _record(self, item: Item, source: Device, destination: Device) -> None:
        self._budget -= item.cost
        self._op_items += 1
        self._moves.extend(Move(rid, source.id, destination.id) for rid in item.request_ids())

    def _move(self, item: Item, dest: Device) -> bool:
        if item.cost > self._budget:
            self._capped = True
            return False
        src = self.fleet.remove(item)
        self.fleet.add(dest, item)
        self._record(item, src, dest)
        return True

    # ---- where an item goes -------------------------------------------------------------
    def _evict_plan(self, dev: Device, need: int, budget: int) -> list[Item] | None:
        """T items to move off `dev` (largest first) to free `need` more units, or None."""
        if need <= 0:
            return []
        if not self.fleet.has_spare():
            return None  # evicted items might find no device: never risk Eq. 2
        plan, freed, cost = [], 0, 0
        for it in sorted(dev.items_of("T"), key=lambda it: -it.size):
            plan.append(it)
            freed += it.size
            cost += it.cost
            if freed >= need:
                break
        if freed < need:
            return None
        if cost > budget:
            self._capped = True
            return None
        return plan

    def _choose(self, item: Item, exclude: Device | None, allow_evict: bool,
                reserve: int) -> tuple[Device | str, list[Item]]:
        size, cls, fleet, cap = item.size, item.cls, self.fleet, self.capacity
        budget = self._budget - reserve
        if cls == "L":
            return NEW, []
        if cls in ("M", "S"):
            best: tuple | None = None
            for dev in fleet.of_category("L"):
                if dev is exclude or dev.counts["M"] or dev.counts["S"]:
                    continue
                large = dev.large()
                if large is None or large.size + size > cap:
                    continue
                plan = [] if size <= dev.free else (self._evict_plan(dev, size - dev.free, budget)
                                                    if allow_evict else None)
                if plan is None:
                    continue
                key = dev.priority_key()
                if best is None or key < best[0]:
                    best = (key, dev, plan)
            if best is not None:
                return best[1], best[2]
            latest = fleet.latest(cls, exclude)
            if latest is not None and latest.counts[cls] < FULL_COUNT[cls]:
                plan = [] if size <= latest.free else (self._evict_plan(latest, size - latest.free, budget)
                                                       if allow_evict else None)
                if plan is not None:
                    return latest, plan
            return NEW, []
        best_dev: Device | None = None
        best_key: tuple | None = None
        for cat in ("L", "M"):
            for dev in fleet.of_category(cat):
                if dev is exclude or dev.free < size or (cat == "M" and dev.counts["M"] < 2):
                    continue
                key = dev.priority_key()
                if best_key is None or key < best_key:
                    best_dev, best_key = dev, key
        if best_dev is not None:
            return best_dev, []
        latest = fleet.latest("T", exclude)
        if latest is not None and latest.free >= size:
            return latest, []
        return NEW, []

    def _best_fit(self, size: int, exclude: Device | None) -> Device | None:
        """Fallback when no device is left to activate: the fullest active device with room."""
        fits = [d for d in self.fleet.active.values() if d is not exclude and d.free >= size]
        return min(fits, key=lambda d: (d.free, d.seq)) if fits else None

    def _clear_evictions(self, plan: list[Item], dest: Device) -> bool:
        """Move the planned T items off `dest` (mandatory for what follows: no cascades)."""
        for ev in plan:
            if not self._relocate(ev, allow_evict=False, follow=False):
                return False
        return True

    def _relocate(self, item: Item, *, allow_evict: bool, follow: bool = True, stay_if_new: bool = False) -> bool:
        """Re-allocate a placed item by the Allocate rules, moving it; False if it stays."""
        src = item.device
        assert src is not None
        if item.cost > self._budget:
            self._capped = True
            return False
        choice, plan = self._choose(item, src, allow_evict, reserve=item.cost)
        if choice == NEW:
            if stay_if_new:
                return False
            dest = self.fleet.activate() or self._best_fit(item.size, src)
            if dest is None:
                return False
        else:
            dest = choice  # type: ignore[assignment]
            if not self._clear_evictions(plan, dest):
                return False
        self._move(item, dest)
        if follow and item.cls in ("L", "M"):
            self._top_up(dest)
        return True

    # ---- after a device lost an item ------------------------------------------------------
    def _settle(self, dev: Device, before: str | None) -> None:
        if not self._alive(dev):
            return
        if not dev.items:
            self.fleet.retire(dev)
        elif demoted(before, dev.category):
            self._evacuate(dev)
        else:
            self._top_up(dev)

    def _evacuate(self, dev: Device) -> None:
        """Fig. 10 Depart rule 4: re-allocate every item of a device whose largest request left.
        An item whose only place would be a new device stays; the device then counts as newly
        activated (it is exactly what the new device would hold)."""
        for item in sorted(dev.items.values(), key=lambda it: (-RANK[it.cls], -it.size)):
            if item.device is dev:  # (a nested refill may already have taken it)
                self._relocate(item, allow_evict=True, stay_if_new=True)
        if not self._alive(dev):
            return
        if not dev.items:
            self.fleet.retire(dev)
        else:
            self.fleet.reactivate(dev)

    def _top_up(self, dev: Device) -> None:
        if not self._alive(dev):
            return
        if self._defer is not None:  # batching (§VI): the batch's arrivals may fill the hole first
            self._defer[dev.id] = dev
            return
        capped, self._capped = self._capped, False
        self._refill(dev)
        if self._capped:
            self._pending[dev.id] = dev
        self._capped = self._capped or capped

    def _refill(self, dev: Device) -> None:
        cat = dev.category
        if cat == "L":
            if not (dev.counts["M"] or dev.counts["S"]):
                self._pull_sm_into_l(dev)
            self._pull_t(dev)
        elif cat in ("M", "S"):
            if dev.counts[cat] < FULL_COUNT[cat] and dev is not self.fleet.latest(cat):
                self._refill_same(dev, cat)
            if cat == "M" and dev.counts["M"] >= 2:
                self._pull_t(dev)
        elif cat == "T" and dev is not self.fleet.latest("T"):
            self._pull_t(dev)

    def _pull_t(self, dev: Device) -> None:
        """Pull T items from the most recently activated T-GPU while `dev` is under 75% (after a departure:
        one, as Fig. 10 Depart rule 2 moves "a T-request")."""
        while self._alive(dev) and not at_least_three_quarters(dev.used, self.capacity):
            src = self.fleet.latest("T")
            if src is None or src is dev:
                return
            fits = [it for it in src.items_of("T") if it.size <= dev.free]
            if not fits:
                return
            item = max(fits, key=lambda it: (it.size, it.key))
            before = src.category
            if not self._move(item, dev):
                return
            self._settle(src, before)
            if self._one_refill:
                return

    def _pull_into(self, dev: Device, item: Item) -> bool:
        """Move `item` into `dev`, moving dev's T items off first if they are in the way."""
        plan = [] if item.size <= dev.free else self._evict_plan(dev, item.size - dev.free, self._budget - item.cost)
        if plan is None:
            return False
        if item.cost + sum(ev.cost for ev in plan) > self._budget:
            self._capped = True
            return False
        src = item.device
        assert src is not None
        before = src.category
        if not self._clear_evictions(plan, dev) or not self._move(item, dev):
            return False
        self._settle(src, before)
        return True

    def _pull_sm_into_l(self, dev: Device) -> None:
        """Fill an L-GPU holding no M/S-request with the fitting M/S-request whose GPU has the
        highest priority (fewest requests, most free memory); the larger request breaks ties."""
        large = dev.large()
        if large is None:
            return
        room = self.capacity - large.size
        best: tuple | None = None
        for cat in ("M", "S"):
            for src in self.fleet.of_category(cat):
                for it in src.items.values():
                    if it.cls in ("M", "S") and it.size <= room:
                        key = (src.priority_key(), -it.size, it.key)
                        if best is None or key < best[0]:
                            best = (key, it)
        if best is not None:
            self._pull_into(dev, best[1])

    def _refill_same(self, dev: Device, cls: str) -> None:
        """A non-latest M/S-GPU short of requests takes one of its class from the latest one."""
        src = self.fleet.latest(cls)
        if src is None or src is dev:
            return
        items = sorted(src.items_of(cls), key=lambda it: (-it.size, it.key))
        room = dev.free + sum(it.size for it in dev.items_of("T"))
        for it in items:
            if it.size <= room:
                self._pull_into(dev, it)
                return

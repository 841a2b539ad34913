"""MELL's online KV-cache scheduler (MELL §VI, Fig. 10, Algorithm 1) as a pure policy.

`MellScheduler` keeps the planned placement of every running request's KV cache on devices of
KV capacity C, and turns each operation -- a request arrives (`allocate`), completes
(`depart`), or its KV grows (`update`) -- into a placement and the migrations Fig. 10
prescribes, at most `max_migrations_per_op` of them (Theorem 3's ten). No I/O, no clock.
The rules and the cap are described in `mell_rules`; the choices this module makes where the
paper is silent or ambiguous:

* Tiny requests (<= C/8) join the currently filling multi-item (bundle) while it stays
  <= C/4, holds fewer than max_migrations_per_op // 2 requests and its device has room;
  otherwise they open a new bundle, placed as a T item. Moving a bundle moves each of its
  requests and counts that many migrations, hence the member limit (a bundle of 50 requests
  could never move under a cap of 10). A bundle is a T item whatever its size, so bundles
  closed by the member limit, or shrunk as members left, may be <= C/8: the departure from
  "multi-items of size (C/8, C/4]" (T-GPU fill >= 75% only needs items <= C/4).
* `update` follows Fig. 10 Update and is called on every growth (Algorithm 1 calls it on class
  changes; a same-class growth only does something when the device would overflow). A class
  change departs and re-allocates the request, except M->L on an M-GPU, which stays (the
  device becomes an L-GPU). An overflow moves off the device's smaller-class requests (T first,
  largest first) when the request is the device's largest class and that is affordable;
  otherwise the request itself moves. Shrinking sizes are accepted and handled alike.
* A departure that empties a device retires it at once (Algorithm 1 retires idle GPUs).
* With a fixed device list, "activate a new GPU" takes the first idle device in list order;
  when none is idle the request goes to the fullest active device with room, else
  `NoCapacity` is raised and nothing changes.
* Fig. 10 moves only: a tiny request that grows into T, or whose bundle would pass C/4, stays on its
  device when it fits there (a T item, or a bundle of its own: Update has no rule for it); a departure
  refills once (Depart rule 2 moves "a T-request"), not until the device is 75% full.
* Batching (§VI): departs, then updates, then allocates, each with its own migration cap; their
  moves are buffered, not executed, and their refills held: the batch's tiny/T arrivals go first into
  the held holes (`_fill_hole`, bundle-aware step 3), then each hole still short gets its one refill.
  The buffer is coalesced (see `mell_ops.coalesce_moves`), and a
  buffered move that a new arrival of the batch makes unnecessary is dropped (`_swap_with_arrivals`:
  the arrival takes the place the move would fill, the moved request stays); `removed_by_batching`
  counts what the buffers dropped (with the refills a filled hole made unnecessary). An update or depart of a
  request allocated in the same batch folds into that allocation (the last size wins; an
  allocate+depart pair vanishes); an update of a request departing in the batch is dropped.
  Within one operation, too, a request moved twice moves once. With `batching=False` the ops
  run in the given order and every op's moves are kept; placements are where each request was
  first put (requests that also departed in the batch left out).
* Beyond the agreed API: `apply(op)`, `capped_operations` (operations that hit the cap),
  `hold(device -> bytes)` (memory a copy still holds: placement leaves it alone), `removed_by_batching`,
  `fleet` (the per-category index, read-only for callers), and `peek_allocate(size)`: the device
  `allocate` would put a request of that size on now, without changing anything (the planner's
  placement hints for the dispatcher, see `mell_placement._peek_destination`).
"""
from __future__ import annotations

from collections.abc import Sequence

from shared.policy.mell_classes import check_capacity, check_size, request_class
from shared.policy.mell_fleet import Item
from shared.policy.mell_ops import (
    Allocate, BatchResult, Depart, Move, NoCapacity, Op, OpResult, Update, coalesce_moves,
)
from shared.policy.mell_placement import MellPlacement
from shared.policy.mell_theorem import total_weight, violations

__all__ = ["Allocate", "BatchResult", "Depart", "MellScheduler", "Move", "NoCapacity", "Op", "OpResult",
           "Update", "request_class"]


class MellScheduler(MellPlacement):
    def __init__(self, capacity: int, devices: Sequence[str] | None = None, *, max_migrations_per_op: int = 10,
                 batching: bool = True, bundle_members: int | None = None, when_full: str = "raise") -> None:
        check_capacity(capacity)
        if devices is not None and len(set(devices)) != len(devices):
            raise ValueError("device ids must be unique")
        if when_full not in ("raise", "wait"):
            raise ValueError(f"when_full must be raise or wait, got {when_full!r}")
        super().__init__(capacity, devices, max_migrations_per_op, bundle_members)
        self.batching = batching
        self.when_full = when_full  # "wait": a batch's arrival that fits nowhere is refused (it waits), a growth
        # that fits nowhere stays where it is, over C (the device's engine preempts)
        self.refused: list[str] = []  # arrivals the last batch refused (when_full="wait")
        self.removed_by_batching = 0  # moves the batches' buffers dropped (coalesced, or made unnecessary)
        self.filled_holes = 0  # arrivals placed into a hole a buffered refill would have filled
        self._holes_filled = 0  # holes the batch's arrivals filled to 75% (a refill each, op by op)

    def hold(self, held: dict[str, int]) -> None:
        """Memory each device physically holds beyond these books (device -> bytes; a device not named holds
        none): copies of requests MELL has moved away that are not handed over yet. Placement treats it as
        taken (no request is put into memory a copy still holds); the growth of requests already there does
        not (the engine holds it back for the seconds the copy takes)."""
        for dev in self.fleet.active.values():
            dev.pinned = held.get(dev.id, 0)

    # ---- queries ------------------------------------------------------------------------
    def device_of(self, request_id: str) -> str | None:
        item = self._item_of.get(request_id)
        return None if item is None or item.device is None else item.device.id

    def requests_on(self, device: str) -> dict[str, int]:
        dev = self.fleet.active.get(device)
        if dev is None:
            return {}
        out: dict[str, int] = {}
        for it in dev.items.values():
            out.update(it.members if it.members is not None else {it.key: it.size})
        return out

    def active_devices(self) -> list[str]:
        return [d.id for d in sorted(self.fleet.active.values(), key=lambda d: d.seq)]

    def used(self, device: str) -> int:
        dev = self.fleet.active.get(device)
        return 0 if dev is None else dev.used

    def weight_lower_bound(self) -> float:
        return float(total_weight(self.fleet))

    def theorem1_violations(self) -> list[str]:
        return violations(self.fleet)

    def peek_allocate(self, size: int) -> str | None:
        """The device `allocate` would choose for a request of `size` now, changing nothing. None when
        it would activate a device that has no id yet (unbounded: a minted one) or fits nowhere
        (NoCapacity); with a device list, activating means its first idle device, which is returned."""
        check_size(size, self.capacity, "size of the peeked request")
        cls = request_class(size, self.capacity)
        if cls == "tiny":
            bundle = self._bundle_with_room(size)
            if bundle is not None:
                assert bundle.device is not None
                return bundle.device.id
            cls = "T"  # a new bundle, placed as a T item
        return self._peek_destination(size, cls)

    # ---- operations -----------------------------------------------------------------------
    def allocate(self, request_id: str, size: int) -> OpResult:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._item_of:
            raise ValueError(f"request {request_id!r} is already allocated (on {self.device_of(request_id)})")
        check_size(size, self.capacity, f"size of request {request_id!r}")
        self._begin_op()
        cls = request_class(size, self.capacity)
        if cls == "tiny":
            self._join_bundle(request_id, size)
        else:
            item = Item(request_id, size, cls)
            self._place(item, reuse=None)
            self._item_of[request_id] = item
        moves = coalesce_moves(self._end_op(), skip={request_id})
        return OpResult({request_id: self.device_of(request_id) or ""}, moves)

    def depart(self, request_id: str) -> OpResult:
        item = self._known(request_id)
        self._begin_op()
        del self._item_of[request_id]
        dev = item.device
        assert dev is not None
        before = dev.category
        self._one_refill = True
        try:
            if item.members is not None and len(item.members) > 1:
                size = item.members.pop(request_id)
                self.fleet.resize(item, item.size - size, "T", cost_delta=-1)
                self._top_up(dev)
            else:
                if item is self._filling:
                    self._filling = None
                self.fleet.remove(item)
                self._settle(dev, before)
            return OpResult({}, coalesce_moves(self._end_op()))
        finally:
            self._one_refill = False

    def update(self, request_id: str, size: int) -> OpResult:
        item = self._known(request_id)
        check_size(size, self.capacity, f"new size of request {request_id!r}")
        self._begin_op()
        cls = request_class(size, self.capacity)
        if item.members is not None:
            self._update_tiny(item, request_id, size, cls)
        else:
            self._update_single(item, size, cls)
        return OpResult({}, coalesce_moves(self._end_op()))

    def apply(self, op: Op) -> OpResult:
        if isinstance(op, Allocate):
            return self.allocate(op.request_id, op.size)
        if isinstance(op, Depart):
            return self.depart(op.request_id)
        if isinstance(op, Update):
            return self.update(op.request_id, op.size)
        raise TypeError(f"not a MELL operation: {op!r}")

    def run_batch(self, ops: Sequence[Op]) -> BatchResult:
        for op in ops:
            if not isinstance(op, (Allocate, Depart, Update)):
                raise TypeError(f"not a MELL operation: {op!r}")
        departed = {op.request_id for op in ops if isinstance(op, Depart)}
        self.refused = []
        if not self.batching:
            placements: dict[str, str] = {}
            moves: list[Move] = []
            for op in ops:
                r = self._apply_or_wait(op)
                placements.update(r.placements)
                moves.extend(r.moves)
            placements = {rid: d for rid, d in placements.items() if rid in self._item_of}
            return BatchResult(placements, tuple(moves), len(moves))
        new_size = {op.request_id: op.size for op in ops if isinstance(op, Allocate)}
        for op in ops:  # an update of a request allocated in this batch sets its starting size
            if isinstance(op, Update) and op.request_id in new_size:
                new_size[op.request_id] = op.size
        born_and_gone = departed & new_size.keys()
        ordered: list[Op] = [op for op in ops if isinstance(op, Depart) and op.request_id not in new_size]
        moot = new_size.keys() | departed  # updates folded into an allocation, or of departing requests
        ordered += [op for op in ops if isinstance(op, Update) and op.request_id not in moot]
        ordered += [Allocate(rid, s) for rid, s in new_size.items() if rid not in born_and_gone]
        buffered: list[Move] = []
        placed: set[str] = set()
        self.fleet.retired.clear()
        holes: dict = {}
        self._defer = holes  # steps (1)-(2): Depart/Update refills held in the buffer
        try:
            for op in ordered:
                if isinstance(op, Allocate) and self._defer is not None:
                    self._defer = None  # step (3): the arrivals, filling the held holes first
                if isinstance(op, Allocate) and holes and self._fill_hole(op.request_id, op.size, holes):
                    placed.add(op.request_id)
                    continue
                r = self._apply_or_wait(op)
                placed.update(r.placements)
                buffered.extend(r.moves)
        finally:
            self._defer = None
        self._one_refill = True  # step (4): the refills the arrivals left to do, one per held hole
        try:
            for dev in holes.values():
                self._begin_op()
                self._top_up(dev)
                buffered.extend(self._end_op())
        finally:
            self._one_refill = False
        placed.difference_update(self.refused)
        unbatched = self._unbatched_moves(buffered)
        final = self._swap_with_arrivals(coalesce_moves(buffered, skip=placed | departed), placed)
        self.removed_by_batching += max(0, unbatched - len(final))
        return BatchResult({rid: self.device_of(rid) or "" for rid in placed}, final, unbatched)

    def _unbatched_moves(self, buffered: list[Move]) -> int:
        """What the batch would have moved op by op: the buffered moves plus the refills its arrivals took
        the place of (one per hole filled)."""
        n, self._holes_filled = len(buffered) + self._holes_filled, 0
        return n

    def _fill_hole(self, request_id: str, size: int, holes: dict) -> bool:
        """§VI step (3), bundle-aware: a tiny or T arrival goes into a device whose refill is held (under 75%,
        where the refill would move a T item in), joining a multi-item there or as one of its own, so the
        refill may not be needed."""
        cls = request_class(size, self.capacity)
        if cls not in ("tiny", "T"):
            return False
        best = None
        for dev in holes.values():
            if not self._alive(dev) or dev.free < size or 4 * dev.used >= 3 * self.capacity:
                continue
            cat = dev.category
            if not (cat == "L" or (cat == "M" and dev.counts["M"] >= 2)
                    or (cat == "T" and dev is not self.fleet.latest("T"))):
                continue
            if best is None or (dev.used, -dev.seq) > (best.used, -best.seq):
                best = dev
        if best is None:
            return False
        if cls == "T":
            item = Item(request_id, size, "T")
            self.fleet.add(best, item)
        else:
            item = next((it for it in best.items.values() if it.members is not None and it is not self._filling
                         and 4 * (it.size + size) <= self.capacity and it.cost < self._bundle_members), None)
            if item is None:
                self._bundles += 1
                item = Item(f"bundle:{self._bundles}", size, "T", {request_id: size})
                self.fleet.add(best, item)
            else:
                assert item.members is not None
                item.members[request_id] = size
                self.fleet.resize(item, item.size + size, "T", cost_delta=1)
        self._item_of[request_id] = item
        self.filled_holes += 1
        if 4 * best.used >= 3 * self.capacity:
            self._holes_filled += 1  # its refill is no longer needed
        return True

    def _apply_or_wait(self, op: Op) -> OpResult:
        """`apply`, or with when_full="wait": an arrival that fits nowhere is refused (it waits), a growth
        that fits nowhere stays, over C."""
        if self.when_full == "raise":
            return self.apply(op)
        try:
            return self.apply(op)
        except NoCapacity:
            done = coalesce_moves(self._moves)  # what the operation moved before it found no room
            if isinstance(op, Allocate):
                self.refused.append(op.request_id)
                return OpResult({}, done)
            if isinstance(op, Update):
                self._grow_in_place(op.request_id, op.size)
                return OpResult({}, done)
            raise

    def _grow_in_place(self, request_id: str, size: int) -> None:
        item = self._known(request_id)
        if item.members is not None:
            old = item.members[request_id]
            item.members[request_id] = size
            self.fleet.resize(item, item.size + size - old, "T")
        else:
            self.fleet.resize(item, size, request_class(size, self.capacity))

    # ---- internals --------------------------------------------------------------------------
    def _swap_with_arrivals(self, moves: tuple[Move, ...], placed: set[str]) -> tuple[Move, ...]:
        """§VI batching, step (3): a buffered move of x from A to B is unnecessary when a request y of
        x's class arrived in the same batch and was placed on A -- or, when the move emptied A (retired),
        on a device of its own: y starts on B instead and x stays on A (A revived, y's device retired).
        The same classes end on the same devices, so Theorem 1's properties hold as they did. Single
        requests only (a bundle moves as all its members)."""
        if not moves or not placed:
            return moves
        arrived: dict[str, list[Item]] = {}
        alone: list[Item] = []  # arrivals that are the only item of their device
        for rid in placed:
            item = self._item_of.get(rid)
            if item is not None and item.members is None and item.device is not None:
                arrived.setdefault(item.device.id, []).append(item)
                if len(item.device.items) == 1:
                    alone.append(item)
        if not arrived:
            return moves
        kept: list[Move] = []
        for m in moves:
            x = self._item_of.get(m.request_id)
            b = x.device if x is not None else None
            if x is None or x.members is not None or b is None or b.id != m.destination:
                kept.append(m)
                continue
            a = self.fleet.active.get(m.source)
            if a is not None:
                fits = [y for y in arrived.get(a.id, ()) if y.cls == x.cls and y.device is a
                        and y.size <= b.free + x.size and x.size <= a.free + y.size]
            else:
                a = self.fleet.retired.get(m.source)
                fits = [] if a is None or a.items else [
                    y for y in alone if y.cls == x.cls and y.device is not None and len(y.device.items) == 1
                    and y.device is not b and y.size <= b.free + x.size]
            if not fits:
                kept.append(m)
                continue
            y = min(fits, key=lambda y: (abs(y.size - x.size), y.key))
            assert y.device is not None
            own = y.device
            if own.id in arrived:
                arrived[own.id].remove(y)
            if y in alone:
                alone.remove(y)
            self.fleet.remove(x)
            self.fleet.remove(y)
            if a.id not in self.fleet.active:  # y had a device to itself: it goes, A comes back
                self.fleet.retire(own)
                self.fleet.revive(a)
            self.fleet.add(a, x)
            self.fleet.add(b, y)
        return tuple(kept)

    def _known(self, request_id: str) -> Item:
        item = self._item_of.get(request_id)
        if item is None:
            raise KeyError(f"request {request_id!r} is not allocated")
        return item

"""MELL's placement for new requests, as hints for the dispatcher (`PlacementHints`, one per model).

MELL's Allocate decides where a new request goes; the dispatcher places new requests. Without hints
the dispatcher routes by load and MELL then migrates every request it would have put elsewhere. With
them, the dispatcher's `mell` routing (shared/policy/routing_mell.py) sends a request of each KV size
class straight to the worker MELL would allocate it to (`MellScheduler.peek_allocate`), so only the
requests the hint got wrong (a burst outgrowing the hinted room, a stale hint) are moved.

Pure: the time is the view's `now`.
"""
from __future__ import annotations

from shared.events.plan import PlacementEntry, PlacementHints, RequestClassName
from shared.policy.mell import MellScheduler
from shared.policy.packer import RepackFit

HINT_INTERVALS = 3.0  # a hint stays valid this many planning intervals (the planner republishes every one)


def class_bounds(capacity: int) -> list[tuple[RequestClassName, int, int]]:
    """(class, lower exclusive, upper inclusive) KV bytes of each non-empty class for capacity C:
    tiny (0, C/8], T (C/8, C/4], S (C/4, C/3], M (C/3, C/2], L (C/2, C], floored as `request_class`
    compares (8*s > C  <=>  s > C//8 for integers)."""
    cuts = [0, capacity // 8, capacity // 4, capacity // 3, capacity // 2, capacity]
    names: tuple[RequestClassName, ...] = ("tiny", "T", "S", "M", "L")
    return [(name, lo, hi) for name, lo, hi in zip(names, cuts, cuts[1:]) if hi > lo]


def model_hints(model: str, scheduler: MellScheduler | RepackFit, now: float, valid_for_s: float) -> PlacementHints:
    """Where MELL would allocate a request of each class of `model` now."""
    capacity = scheduler.capacity
    entries = []
    for name, lower, upper in class_bounds(capacity):
        # The class's smallest size stands for it: MELL ranks the devices a class may use (workload
        # priority, most recent of a category) the same for every size of the class; size only decides
        # whether it fits. So the smallest size gets the device MELL prefers for the class whenever any
        # member fits there, and a member too large for it is caught by `room_bytes` (the dispatcher
        # then routes by load and MELL moves it if it must). A larger stand-in would send every small
        # member to a fresh device instead: more devices, more consolidation moves.
        worker = scheduler.peek_allocate(lower + 1)
        room = capacity if worker is None else capacity - scheduler.used(worker)
        entries.append(PlacementEntry(request_class=name, lower_bytes=lower, upper_bytes=upper, worker_id=worker,
                                      room_bytes=max(0, room)))
    return PlacementHints(model=model, ts=now, capacity_bytes=capacity, entries=entries, valid_until=now + valid_for_s)


__all__ = ["HINT_INTERVALS", "class_bounds", "model_hints"]

"""`MellScheduler.peek_allocate`: the device Allocate would choose now, without changing anything.

Over random operation sequences (allocate / grow / depart, every class, with and without a device
list), before every allocate: peek for the request's size equals where `allocate` then puts it
(None exactly when allocate activates a device with no id yet), and peeking for one size of every
class leaves the scheduler's whole placement as it was.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.mell import MellScheduler, request_class

C = 2400
# one size per class (tiny, T, S, M, L), each its class's smallest
CLASS_SIZES = (1, C // 8 + 1, C // 4 + 1, C // 3 + 1, C // 2 + 1)


def _snapshot(s: MellScheduler) -> tuple:
    placement = {d: s.requests_on(d) for d in s.active_devices()}
    return (placement, [s.used(d) for d in s.active_devices()], s.fleet.next_spare(), s.capped_operations,
            s._filling.key if s._filling is not None else None)


def _drive(s: MellScheduler, rng: random.Random, steps: int) -> tuple[int, int]:
    """Random ops; before each allocate, peek must agree with it. Returns (allocates, peeks on a device)."""
    live: dict[str, int] = {}
    allocs = hits = 0
    for n in range(steps):
        kind = rng.choice(["alloc", "alloc", "alloc", "grow", "depart"])
        if kind == "alloc" or not live:
            size = rng.randint(1, C) if rng.random() < 0.5 else rng.randint(1, C // 8)
            before = set(s.active_devices())
            for probe in CLASS_SIZES:  # peeking at every class changes nothing
                snap = _snapshot(s)
                s.peek_allocate(probe)
                assert _snapshot(s) == snap, f"peek_allocate({probe}) changed the scheduler"
            peeked = s.peek_allocate(size)
            rid = f"r{n}"
            placed = s.allocate(rid, size).placements[rid]
            cls = request_class(size, C)
            if peeked is None:
                assert placed not in before, f"{cls} request of {size}: peek said a new device, it went to {placed}"
            else:
                assert peeked == placed, f"{cls} request of {size}: peek said {peeked}, allocate chose {placed}"
                hits += 1
            live[rid] = size
            allocs += 1
        elif kind == "depart":
            rid = rng.choice(sorted(live))
            del live[rid]
            s.depart(rid)
        else:
            rid = rng.choice(sorted(live))
            live[rid] = min(C, live[rid] + rng.randint(1, C // 6))
            s.update(rid, live[rid])
    return allocs, hits


@pytest.mark.parametrize("seed", range(12))
def test_peek_equals_allocate_on_unbounded_devices(seed: int) -> None:
    allocs, hits = _drive(MellScheduler(C), random.Random(seed), 300)
    assert allocs > 100 and hits > 20  # existing devices were chosen often, not only new ones


@pytest.mark.parametrize("seed", range(6))
def test_peek_names_the_next_idle_device_of_a_device_list(seed: int) -> None:
    s = MellScheduler(C, [f"w{i}" for i in range(200)])
    assert s.peek_allocate(C) == "w0"  # an L request activates the list's first idle device
    _drive(s, random.Random(100 + seed), 300)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, C), st.booleans()), min_size=1, max_size=80))
def test_peek_agrees_for_every_class_in_any_arrival_order(sizes: list[tuple[int, bool]]) -> None:
    s = MellScheduler(C, [f"w{i}" for i in range(100)])
    for n, (size, small) in enumerate(sizes):
        size = max(1, size // 12) if small else size
        peeked = s.peek_allocate(size)
        assert s.allocate(f"r{n}", size).placements[f"r{n}"] == peeked


def test_no_room_on_a_full_device_list_peeks_none() -> None:
    s = MellScheduler(C, ["w0", "w1"])
    s.allocate("a", C)
    s.allocate("b", C)
    assert s.peek_allocate(C // 2 + 1) is None
    with pytest.raises(ValueError, match="outside"):
        s.peek_allocate(C + 1)

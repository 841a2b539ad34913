"""Tidal's own KV packer (shared/policy/packer.py): Eq. 2 after every batch, the worst-case bound
peak <= 2 * max_t OPT(t) + 1 against exact optima on small instances (hypothesis), and its rules."""
from __future__ import annotations

from functools import lru_cache

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.mell_ops import Allocate, Depart, Move, Update
from shared.policy.packer import RepackFit

C = 100


@lru_cache(maxsize=None)
def opt_bins(sizes: tuple[int, ...]) -> int:
    """The exact optimum of bin packing (capacity C) by search, largest first, for a handful of items."""
    items = sorted(sizes, reverse=True)
    best = len(items)

    def place(k: int, bins: list[int]) -> None:
        nonlocal best
        if len(bins) >= best:
            return
        if k == len(items):
            best = len(bins)
            return
        seen = set()
        for j, load in enumerate(bins):
            if load + items[k] <= C and load not in seen:
                seen.add(load)
                bins[j] += items[k]
                place(k + 1, bins)
                bins[j] -= items[k]
        bins.append(items[k])
        place(k + 1, bins)
        bins.pop()

    place(0, [])
    return best


def test_exact_optimum_of_small_instances() -> None:
    assert opt_bins((60, 50, 40, 30, 20)) == 2
    assert opt_bins((51, 51, 51)) == 3
    assert opt_bins(()) == 0


step = st.tuples(st.sampled_from(["alloc", "alloc", "grow", "depart"]), st.integers(0, 10**6), st.integers(1, C))


@settings(max_examples=80, deadline=None)
@given(st.lists(step, min_size=1, max_size=40), st.integers(1, 4), st.booleans(), st.integers(0, 10))
def test_eq2_holds_and_peak_is_within_twice_the_exact_optimum_plus_one(steps, batch, balanced, migrate_out) -> None:
    """Batches as the fleet runs them, and with `balance=True` its balancing round after each (as `tidal repro
    mell` runs ours): the round moves requests between active devices only, never opening one, so the bound
    (a device opens only when no two active ones fit into one) is untouched."""
    p = RepackFit(C, balance=balanced, migrate_out_free=migrate_out)
    live: dict[str, int] = {}
    shadow: dict[str, str] = {}
    ops: list = []
    for n, (kind, pick, size) in enumerate(steps):
        if kind == "alloc" or not live:
            live[f"r{n}"] = size
            ops.append(Allocate(f"r{n}", size))
        elif kind == "depart":
            rid = sorted(live)[pick % len(live)]
            del live[rid]
            ops.append(Depart(rid))
        else:
            rid = sorted(live)[pick % len(live)]
            live[rid] = min(C, live[rid] + size // 3 + 1)
            ops.append(Update(rid, live[rid]))
    books: dict[str, int] = {}
    peak_opt = peak = 0
    chunks: list[list] = [[]]
    for op in ops:  # a batch touches a request once (as the fleet's do)
        if len(chunks[-1]) >= batch or any(o.request_id == op.request_id for o in chunks[-1]):
            chunks.append([])
        chunks[-1].append(op)
    for chunk in chunks:
        r = p.run_batch(chunk)
        for op in chunk:
            if isinstance(op, Depart):
                books.pop(op.request_id, None)
                shadow.pop(op.request_id, None)
            else:
                books[op.request_id] = op.size
        shadow.update({rid: d for rid, d in r.placements.items() if rid in books})
        moves = list(r.moves)
        if balanced:
            opened = len(p.active_devices())
            moves += p.balance()
            assert len(p.active_devices()) == opened  # balancing never opens (nor retires) a device
        for m in moves:
            assert shadow[m.request_id] == m.source, m
            shadow[m.request_id] = m.destination
        active = p.active_devices()
        for d in active:  # Eq. 2, and the moves replayed give the packer's placement
            on = p.requests_on(d)
            assert on and sum(on.values()) == p.used(d) <= C
            assert all(shadow[rid] == d for rid in on)
        assert sum(p.used(d) for d in active) == sum(books.values())
        peak = max(peak, len(active))
        peak_opt = max(peak_opt, opt_bins(tuple(books.values())) if len(books) <= 9 else -(-sum(books.values()) // C))
        if len(books) <= 9:
            assert peak <= 2 * peak_opt + 1, (peak, peak_opt)


def test_an_overflow_is_relieved_after_the_batchs_arrivals_by_the_smallest_request_that_ends_it() -> None:
    p = RepackFit(C)
    p.run_batch([Allocate("a", 50), Allocate("b", 20), Allocate("c", 25)])  # one device: 95
    assert p.active_devices() == ["gpu-0"]
    r = p.run_batch([Update("a", 58), Allocate("d", 30)])  # 103 on gpu-0; d opens gpu-1 first
    assert r.placements == {"d": "gpu-1"}
    assert r.moves == (Move("b", "gpu-0", "gpu-1"),)  # 20 >= the 3 over, the smallest that ends it
    assert p.used("gpu-0") == 83 and p.used("gpu-1") == 50


def test_room_is_made_by_moving_a_request_before_a_device_is_opened() -> None:
    p = RepackFit(C)
    p.run_batch([Allocate("a", 70), Allocate("b", 60)])  # gpu-0: a, gpu-1: b
    p.run_batch([Allocate("c", 25)])  # worst fit: gpu-1 (85)
    r = p.run_batch([Allocate("d", 35)])  # fits nowhere (30 / 15 free): c moves to gpu-0, d takes its place
    assert r.moves == (Move("c", "gpu-1", "gpu-0"),) and r.placements == {"d": "gpu-1"}
    assert p.active_devices() == ["gpu-0", "gpu-1"]


def test_devices_are_consolidated_before_one_is_opened() -> None:
    p = RepackFit(C, room_moves=0)
    p.run_batch([Allocate("a", 60), Allocate("b", 60)])  # gpu-0: a, gpu-1: b
    p.run_batch([Allocate("x", 30), Allocate("y", 30)])  # worst fit: x on gpu-0, y on gpu-1
    p.run_batch([Depart("a"), Depart("b")])  # x and y left on two devices 30% full
    assert len(p.active_devices()) == 2
    r = p.run_batch([Allocate("z", 95)])  # needs a device: the two merge first, so z takes a second, not a third
    assert r.moves == (Move("y", "gpu-1", "gpu-0"),) and p.merges == 1
    assert len(p.active_devices()) == 2 and p.requests_on("gpu-0") == {"x": 30, "y": 30}


def test_a_full_pool_refuses_an_arrival_and_leaves_a_growth_over_capacity() -> None:
    p = RepackFit(C, ["g0"])
    p.when_full = "wait"
    r = p.run_batch([Allocate("a", 80), Allocate("b", 30)])
    assert r.placements == {"a": "g0"} and p.refused == ["b"]
    r = p.run_batch([Update("a", 100), Allocate("c", 10)])
    assert p.refused == ["c"] and r.moves == () and p.used("g0") == 100


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, C), max_size=12), st.integers(1, C), st.booleans(), st.booleans())
def test_peek_allocate_changes_nothing_and_names_where_an_arrival_that_fits_goes(sizes, size, spread, pool) -> None:
    """The planner's hints: `peek_allocate` leaves the books as they were, and when it names a device in use
    that has room, `allocate` puts the request there without moving anything."""
    p = RepackFit(C, [f"w{i}" for i in range(len(sizes) + 1)] if pool else None, spread=spread)
    for i, s in enumerate(sizes):
        p.allocate(f"r{i}", s)
    before = (dict(p._loc), dict(p._load), list(p._order))
    peeked = p.peek_allocate(size)
    assert (dict(p._loc), dict(p._load), list(p._order)) == before
    if not pool:
        assert peeked is None or peeked in p._order
    if peeked is not None and peeked in p._order and p._free(peeked) >= size:
        got = p.allocate("new", size)
        assert got.placements == {"new": peeked} and not got.moves
    elif peeked is not None:  # an idle device of the list: the arrival fits on none in use (or spreads there)
        assert peeked not in p._order and pool


def test_the_balancing_round_moves_the_smallest_request_off_a_device_short_of_room_per_request() -> None:
    """balance=True: a device with under `migrate_out_free` free per request sheds its smallest request to the
    freest device when that does not reverse the pair (Llumnix's round, binpack_lb.py); nothing opens."""
    for threshold, moved in ((1, []), (5, [Move("s1", "gpu-0", "gpu-1")])):
        p = RepackFit(C, balance=True, migrate_out_free=threshold)
        p.run_batch([Allocate("s1", 30), Allocate("s2", 30), Allocate("s3", 34)])  # gpu-0: 94, 2 free per request
        p.run_batch([Allocate("t", 20)])  # fits nowhere, no room can be made: gpu-1 opens
        assert p.active_devices() == ["gpu-0", "gpu-1"]
        assert p.balance() == moved, threshold  # 30 moved: 64 / 2 left per request, 50 / 2 on gpu-1
        assert len(p.active_devices()) == 2 and p.used("gpu-0") + p.used("gpu-1") == 114

"""MELL's moves as Fig. 10 prescribes them, §VI batching that removes a move, and Theorem 3's count
(shared/policy/mell*.py): a grown request that fits where it is stays; a held refill is filled by the
batch's arrival; a multi-item counts once per operation."""
from __future__ import annotations

from shared.policy.mell import Allocate, Depart, MellScheduler, Move, Update

C = 2400  # tiny <= 300 < T <= 600 < S <= 800 < M <= 1200 < L


def test_a_tiny_request_that_grows_into_t_stays_where_it_fits() -> None:
    s = MellScheduler(C)
    s.allocate("a", 200)  # a bundle on gpu-0 (a T-GPU)
    s.allocate("m1", 900)
    s.allocate("m2", 900)  # gpu-1: a full M-GPU, 600 free (Allocate rule 1 would put a T-request there)
    assert s.device_of("a") == "gpu-0" and s.device_of("m2") == "gpu-1"
    r = s.update("a", 350)  # tiny -> T: Fig. 10 Update has no rule for it, and it fits on gpu-0
    assert r.moves == () and s.device_of("a") == "gpu-0" and s.requests_on("gpu-0") == {"a": 350}
    assert s.theorem1_violations() == []


def test_a_request_leaving_a_full_bundle_stays_as_a_multi_item_of_its_own() -> None:
    s = MellScheduler(C)
    for rid in ("a", "b", "c"):
        s.allocate(rid, 190)  # one bundle of 570 on gpu-0
    r = s.update("a", 290)  # the bundle would pass C/4: a leaves it, in place
    assert r.moves == () and s.requests_on("gpu-0") == {"a": 290, "b": 190, "c": 190}
    assert s._item_of["a"] is not s._item_of["b"]


def _hole_setup(batching: bool) -> MellScheduler:
    s = MellScheduler(C, batching=batching)
    for rid in ("t1", "t2", "t3", "t4"):
        s.allocate(rid, 590)  # gpu-0: 2360
    s.allocate("s1", 350)
    s.allocate("s2", 350)  # gpu-1, the latest T-GPU: 700
    return s


def test_a_held_refill_is_filled_by_the_batchs_arrival_and_the_move_is_dropped() -> None:
    one = _hole_setup(batching=False)
    r1 = one.run_batch([Depart("t1"), Allocate("t5", 450)])
    assert r1.moves == (Move("s2", "gpu-1", "gpu-0"),) or r1.moves == (Move("s1", "gpu-1", "gpu-0"),)
    batched = _hole_setup(batching=True)
    r2 = batched.run_batch([Depart("t1"), Allocate("t5", 450)])
    assert r2.moves == () and r2.placements == {"t5": "gpu-0"}  # the arrival fills the hole: no refill needed
    assert r2.moves_before_dedup == 1 and batched.removed_by_batching == 1 and batched.filled_holes == 1
    assert batched.used("gpu-0") == 2220 and batched.theorem1_violations() == []


def test_a_departure_refills_once() -> None:
    s = MellScheduler(C)
    for rid in ("t1", "t2", "t3", "t4"):
        s.allocate(rid, 590)  # gpu-0: 2360
    for k in range(6):
        s.allocate(f"u{k}", 310)  # gpu-1, the latest T-GPU
    s.fleet.resize(s._item_of["t2"], 100, "T")  # gpu-0: 1870, still >= 75% (set directly: a shrunk T item)
    r = s.depart("t1")  # gpu-0: 1280 < 75%: Fig. 10 moves one T-request in (a loop "until 75%" would move two)
    assert len(r.moves) == 1 and r.moves[0].destination == "gpu-0" and s.used("gpu-0") == 1590


def test_theorem_3_counts_a_multi_item_once() -> None:
    s = MellScheduler(C)
    for rid in ("a", "b", "c"):
        s.allocate(rid, 100)  # a bundle of three on gpu-0
    r = s.allocate("big", 1300)  # a new L-GPU under 75% pulls the T-GPU's multi-item
    assert len(r.moves) == 3 and s.last_op_items == 1

"""MELL §VI request-operation batching: departs, then updates, then allocates; redundant moves go."""
from __future__ import annotations

from shared.policy.mell import Allocate, Depart, MellScheduler, Move, Update
from shared.policy.mell_ops import coalesce_moves

C = 2400


def test_coalescing_chains_round_trips_and_skipped_requests() -> None:
    moves = [Move("a", "g0", "g1"), Move("b", "g0", "g1"), Move("a", "g1", "g2"), Move("b", "g1", "g0"),
             Move("c", "g3", "g4")]
    assert coalesce_moves(moves) == (Move("a", "g0", "g2"), Move("c", "g3", "g4"))
    assert coalesce_moves(moves, skip={"c"}) == (Move("a", "g0", "g2"),)


def _three_m_gpus(batching: bool) -> MellScheduler:
    s = MellScheduler(C, batching=batching)
    for rid, size in (("a", 1150), ("b", 1150), ("c", 1100), ("d", 1150), ("e", 850)):
        s.allocate(rid, size)  # gpu-0: a b; gpu-1: c d; gpu-2 (latest M-GPU): e
    return s


def test_a_to_b_then_b_to_c_becomes_a_to_c() -> None:
    s = _three_m_gpus(batching=True)
    # op by op, Depart(c) refills gpu-1 with e from gpu-2 and the new L then takes e (the only M that
    # fits beside it) from gpu-1: e moves gpu-2 -> gpu-1 -> gpu-3
    one = _three_m_gpus(batching=False).run_batch([Depart("c"), Allocate("big", 1300)])
    assert one.moves == (Move("e", "gpu-2", "gpu-1"), Move("e", "gpu-1", "gpu-3"))
    # batched, the refill is held (§VI step 1): the L takes e from gpu-2, which empties, so gpu-1 is the
    # latest M-GPU and needs no refill: one move, nothing buffered beside it
    r = s.run_batch([Allocate("big", 1300), Depart("c")])
    assert r.placements == {"big": "gpu-3"}
    assert r.moves == (Move("e", "gpu-2", "gpu-3"),)
    assert r.moves_before_dedup == 1
    assert s.device_of("e") == "gpu-3" and s.theorem1_violations() == []


def test_a_request_that_departs_in_the_batch_is_not_moved() -> None:
    ops = [Allocate("big", 1300), Depart("e")]
    one_by_one = _three_m_gpus(batching=False).run_batch(ops)
    # e is pulled in beside the new L, then departs, and c refills the L-GPU
    assert one_by_one.moves == (Move("e", "gpu-2", "gpu-3"), Move("c", "gpu-1", "gpu-3"))
    batched = _three_m_gpus(batching=True).run_batch(ops)  # e departs first: only c moves
    assert batched.moves == (Move("c", "gpu-1", "gpu-3"),) and batched.moves_before_dedup == 1


def test_ops_on_a_request_allocated_in_the_same_batch_fold_into_its_allocation() -> None:
    s = MellScheduler(C)
    r = s.run_batch([Allocate("x", 500), Update("x", 1300), Allocate("y", 100), Depart("y")])
    assert r.placements == {"x": "gpu-0"} and s.requests_on("gpu-0") == {"x": 1300}
    assert s.device_of("y") is None


def test_without_batching_ops_run_in_order() -> None:
    s = MellScheduler(C, batching=False)
    r = s.run_batch([Allocate("x", 500), Update("x", 1300), Depart("x"), Allocate("y", 1300)])
    assert r.placements == {"y": "gpu-1"}  # gpu-0 was activated for x, then retired
    assert s.active_devices() == ["gpu-1"]


def test_a_move_an_arrival_of_the_batch_makes_unnecessary_is_dropped() -> None:
    """§VI step (3): c departs from gpu-1 (a non-latest M-GPU), whose refill pulls e from the latest M-GPU
    gpu-2, which empties; an M-request f arriving in the same batch then needs a new GPU. One by one, e moves
    and f opens gpu-3. Batched, f takes e's would-be place on gpu-1 and e stays on gpu-2: the same GPUs and
    classes, no migration."""
    one_by_one = _three_m_gpus(batching=False)
    r1 = one_by_one.run_batch([Depart("c"), Allocate("f", 900)])
    assert r1.moves == (Move("e", "gpu-2", "gpu-1"),) and one_by_one.device_of("f") == "gpu-3"
    batched = _three_m_gpus(batching=True)
    r2 = batched.run_batch([Depart("c"), Allocate("f", 900)])
    assert r2.moves == () and r2.moves_before_dedup == 1 and batched.removed_by_batching == 1
    assert r2.placements == {"f": "gpu-1"} and batched.device_of("e") == "gpu-2"
    assert batched.requests_on("gpu-1") == {"d": 1150, "f": 900}
    assert batched.active_devices() == ["gpu-0", "gpu-1", "gpu-2"] and batched.theorem1_violations() == []
    # the arrival placed where the moved request came from: the same swap
    s = _three_m_gpus(batching=True)
    s.allocate("g", 850)  # gpu-2 now holds e and g
    r3 = s.run_batch([Depart("c"), Allocate("h", 860)])  # refill pulls one from gpu-2; h would go there
    assert r3.moves == () and s.device_of("h") == "gpu-1" and s.removed_by_batching == 1


def test_memory_a_copy_still_holds_is_left_alone_by_placement_not_by_growth() -> None:
    s = MellScheduler(C)
    s.allocate("a", 700)  # T... an S-request (C/4 < 700 <= C/3): gpu-0
    s.allocate("b", 700)  # gpu-0, the latest S-GPU
    s.hold({"gpu-0": 900})  # a copy of a request MELL moved away still holds 900 there
    assert s.allocate("c", 700).placements == {"c": "gpu-1"}  # 700 would fit the books, not the device
    assert s.update("a", 790).moves == ()  # its own requests still grow in place
    s.hold({})
    assert s.allocate("d", 700).placements == {"d": "gpu-1"}  # gpu-1 is now the latest S-GPU

"""BF, WF and LB (MELL §VIII-B baselines), the hindsight reserving arms and the restart ablation on
small hand-made operation sequences; LB (Llumnix) on random ones."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.policy.binpack_baselines import (
    BASELINES, BestFit, BestFitReserve, BestFitRestart, LoadBalance, NoCapacity, WorstFit, WorstFitReserve,
    WorstFitRestart,
)
from shared.policy.mell import MellScheduler
from shared.policy.mell_ops import Allocate, Depart, Move, Update


def loads(policy) -> dict[str, int]:
    return {d: policy.used(d) for d in policy.active_devices()}


def test_best_fit_picks_the_tightest_device_and_worst_fit_the_emptiest() -> None:
    for cls, expect in ((BestFit, "gpu-1"), (WorstFit, "gpu-0")):
        p = cls(100)
        p.allocate("a", 30)   # gpu-0: 30
        p.allocate("b", 60)   # fits gpu-0 (free 70): both put it there -> gpu-0: 90
        p.allocate("c", 50)   # fits nowhere -> gpu-1: 50
        assert p.device_of("b") == "gpu-0" and p.device_of("c") == "gpu-1"
        p.depart("b")         # gpu-0: 30 (free 70), gpu-1: 50 (free 50)
        res = p.allocate("d", 40)
        assert res.placements == {"d": expect}, cls.name
        assert res.moves == ()


def test_a_device_is_activated_when_nothing_fits_and_retired_when_it_empties() -> None:
    p = BestFit(100)
    p.allocate("a", 80)
    p.allocate("b", 80)
    assert p.active_devices() == ["gpu-0", "gpu-1"]
    p.depart("a")
    assert p.active_devices() == ["gpu-1"]
    assert p.allocate("c", 10).placements == {"c": "gpu-1"}
    assert p.allocate("d", 90).placements == {"d": "gpu-2"}  # ids are never reused


def test_given_devices_bound_the_fleet_with_a_clear_error() -> None:
    p = WorstFit(100, devices=["w1", "w2"])
    p.allocate("a", 70)
    p.allocate("b", 70)
    with pytest.raises(NoCapacity, match="request c .*70 bytes.*2 devices"):
        p.allocate("c", 70)


def test_bad_input_is_refused_by_name() -> None:
    p = BestFit(100)
    with pytest.raises(ValueError, match="'a'.*size 101"):
        p.allocate("a", 101)
    p.allocate("a", 10)
    with pytest.raises(ValueError, match="already placed"):
        p.allocate("a", 10)
    with pytest.raises(ValueError, match="unknown request 'zz'"):
        p.update("zz", 20)


def test_bf_and_wf_admit_on_what_is_known_and_let_the_engine_preempt_the_growth() -> None:
    """No hindsight: two requests of 30 share a GPU; they grow to 60 each and the books hold 120 > C on it.
    Nothing moves (the device's engine preempts, loadgen/sim/kv_packing_fleet.py), and while the books are
    over C no arrival is put there."""
    for cls in (BestFit, WorstFit):
        p = cls(100)
        assert p.run_batch([Allocate("a", 30), Allocate("b", 30)]).placements == {"a": "gpu-0", "b": "gpu-0"}
        res = p.run_batch([Update("a", 60), Update("b", 60)])
        assert res.moves == () and p.charged("gpu-0") == 120 and p.used("gpu-0") == 120
        assert p.allocate("c", 1).placements == {"c": "gpu-1"}, cls.name


def test_the_reserving_arms_hold_the_final_size_from_admission() -> None:
    """Two requests of 30 that will grow to 60: reserving their final size (hindsight) needs two GPUs from
    the start; MELL, sizing by the current KV, keeps both on one GPU as they grow to 45 each."""
    ops = [[Allocate("a", 30), Allocate("b", 30)], [Update("a", 45), Update("b", 45)], [Depart("a"), Depart("b")]]
    final = {"a": 60, "b": 60}
    for cls in (BestFitReserve, WorstFitReserve):
        p = cls(100, final_size=final)
        mell = MellScheduler(100)
        counts = []
        for batch in ops[:2]:
            assert p.run_batch(batch).moves == ()
            mell.run_batch(batch)
            counts.append((len(p.active_devices()), len(mell.active_devices())))
        assert counts == [(2, 1), (2, 1)], cls.name
        assert loads(p) == {"gpu-0": 45, "gpu-1": 45}  # in use; the rest is reserved, not used
        assert {d: p.charged(d) for d in p.active_devices()} == {"gpu-0": 60, "gpu-1": 60}
        p.run_batch(ops[2])
        assert p.active_devices() == []


def test_reserving_arms_refuse_growth_past_the_reservation_by_name() -> None:
    p = WorstFitReserve(100, final_size={"a": 50})
    with pytest.raises(ValueError, match="no final size for request 'b'"):
        p.allocate("b", 10)
    with pytest.raises(ValueError, match="'a'.*final size 50.*size 60"):
        p.allocate("a", 60)
    p.allocate("a", 20)
    p.update("a", 50)
    with pytest.raises(ValueError, match="'a' grew to 51 B, past the 50 B reserved"):
        p.update("a", 51)


def test_restart_ablation_restarts_the_newest_request_elsewhere() -> None:
    for cls, expect in ((BestFitRestart, "gpu-1"), (WorstFitRestart, "gpu-2")):
        p = cls(100)
        p.allocate("old", 40)
        p.allocate("new", 40)      # both on gpu-0 (80): admitted at current size
        p.allocate("p1", 90)       # gpu-1
        p.allocate("p2", 90)       # gpu-2
        p.update("p1", 50)
        p.update("p2", 30)         # gpu-1 free 50, gpu-2 free 70
        res = p.update("old", 70)  # gpu-0 would hold 110: the newest request is preempted and restarted
        assert res.moves == (Move("new", "gpu-0", expect),), cls.name
        assert p.used(expect) == {"gpu-1": 90, "gpu-2": 70}[expect]
    assert BASELINES["BF"] is BestFit and BASELINES["BF-reserve"] is BestFitReserve
    assert not BestFit.migrates and not BestFitRestart.migrates and LoadBalance.migrates


def test_what_a_copy_still_holds_is_left_alone_by_fit_decisions() -> None:
    for cls in (BestFit, WorstFit, LoadBalance):
        p = cls(100)
        p.allocate("a", 40)
        p.held = {"gpu-0": 50}  # a copy of a request the books moved away is still on gpu-0
        assert p.allocate("b", 20).placements == {"b": "gpu-1"}, cls.name
        p.held = {}
        assert p.allocate("c", 20).placements["c"] in ("gpu-0", "gpu-1")


def test_a_failed_migration_is_put_back_even_on_a_device_the_books_retired() -> None:
    p = LoadBalance(100)
    p.allocate("a", 50)                            # gpu-0
    p.allocate("b", 60)                            # gpu-1
    p.run_batch([Update("b", 90)])
    p.relocate("a", "gpu-1")                       # the books moved a away: gpu-0 is empty, retired
    assert p.active_devices() == ["gpu-1"]
    p.relocate("a", "gpu-0")                       # the copy failed: a never left gpu-0
    assert p.device_of("a") == "gpu-0" and loads(p) == {"gpu-1": 90, "gpu-0": 50}


def test_load_balance_survives_the_make_room_crash_case() -> None:
    """The old LB emptied the very GPU it then put the arrival on (KeyError): GPU capacity 240, allocate 141,
    56, 83, 74, depart the 141, allocate 237."""
    p = LoadBalance(240)
    for i, size in enumerate((141, 56, 83, 74)):
        p.allocate(f"r{i}", size)
    p.depart("r0")
    res = p.allocate("r4", 237)
    assert res.moves == () and p.used(res.placements["r4"]) == 237
    assert p.balance() == []  # nothing is overloaded
    assert sum(loads(p).values()) == 56 + 83 + 74 + 237


def test_llumnix_balancing_moves_the_shortest_request_off_an_overloaded_gpu() -> None:
    p = LoadBalance(100, migrate_out_free=3)
    p.allocate("a", 50)        # gpu-0
    p.allocate("b", 30)        # gpu-0: 80
    p.allocate("c", 15)        # gpu-0: 95
    p.allocate("d", 10)        # gpu-1 (worst fit: gpu-0 has 5 free)
    p.run_batch([Update("a", 70)])  # gpu-0 holds 115 > C: its engine preempts; LB moves load off it
    moves = p.balance()
    assert moves == [Move("c", "gpu-0", "gpu-1")]  # the shortest that fits and narrows the gap
    assert loads(p) == {"gpu-0": 100, "gpu-1": 25}
    assert p.balance() == []  # gpu-0: 0 free over 2 requests < 3, but moving b (30) would reverse the pair
    # a GPU with a migration in flight takes no part (one migration per GPU at a time)
    p.run_batch([Update("a", 80)])
    assert p.balance(busy={"gpu-1"}) == []
    assert p.balance(movable=lambda rid: rid != "b") == []


@st.composite
def op_sequences(draw):
    steps = draw(st.lists(st.tuples(st.sampled_from(["alloc", "alloc", "grow", "depart", "balance"]),
                                    st.integers(0, 10**6), st.integers(1, 240)), min_size=1, max_size=120))
    return steps


@settings(max_examples=300, deadline=None)
@given(op_sequences(), st.integers(0, 30))
def test_load_balance_survives_random_sequences(steps, threshold: int) -> None:
    """Random allocate / grow / depart / balance sequences on C = 240: LB never crashes, never loses or
    duplicates a request, every move starts where the request is, and balancing never books a GPU past C."""
    C = 240
    p = LoadBalance(C, migrate_out_free=threshold)
    live: dict[str, int] = {}
    where: dict[str, str] = {}
    for n, (kind, pick, size) in enumerate(steps):
        if kind == "alloc" or (not live and kind != "balance"):
            rid = f"r{n}"
            live[rid] = size
            where.update(p.allocate(rid, size).placements)
        elif kind == "balance":
            before = {d: p.charged(d) for d in p.active_devices()}
            for m in p.balance():
                assert where[m.request_id] == m.source, m
                where[m.request_id] = m.destination
                assert p.charged(m.destination) <= C
                assert before[m.source] > p.charged(m.source)
        else:
            rid = sorted(live)[pick % len(live)]
            if kind == "depart":
                p.depart(rid)
                del live[rid], where[rid]
            else:
                live[rid] = min(C, live[rid] + size // 4 + 1)
                assert p.update(rid, live[rid]).moves == ()
        assert {r: p.device_of(r) for r in live} == where
        assert sum(loads(p).values()) == sum(live.values())
        assert all(p.requests_on(d) for d in p.active_devices())

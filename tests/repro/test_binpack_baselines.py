"""BF, WF and LB (MELL §VIII-B baselines) and the BF/WF-restart ablation on small hand-made
operation sequences."""
from __future__ import annotations

import pytest

from shared.policy.binpack_baselines import (
    BASELINES, BestFit, BestFitRestart, LoadBalance, NoCapacity, WorstFit, WorstFitRestart,
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


def test_bf_and_wf_reserve_the_final_size_so_growth_never_overflows() -> None:
    """Two requests of 30 that will grow to 60: BF/WF admit on their final size (60 + 60 > 100),
    so they need two GPUs from the start; MELL sizes by the current KV, keeps both on one GPU as
    they grow to 45 each, and never needs a second one."""
    ops = [[Allocate("a", 30), Allocate("b", 30)], [Update("a", 45), Update("b", 45)], [Depart("a"), Depart("b")]]
    final = {"a": 60, "b": 60}
    for cls in (BestFit, WorstFit):
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
        assert p.requests_on("gpu-0") == {"a": 45}
        p.run_batch(ops[2])
        assert p.active_devices() == []


def test_a_reservation_is_held_and_reused_by_fit_decisions() -> None:
    p = BestFit(100, final_size={"a": 70, "b": 30, "c": 40})
    p.allocate("a", 10)                         # reserves 70 on gpu-0
    assert p.allocate("b", 10).placements == {"b": "gpu-0"}  # 70 + 30 fits exactly
    assert p.allocate("c", 5).placements == {"c": "gpu-1"}   # gpu-0 has 80 B free in use, none reserved
    assert p.used("gpu-0") == 20 and p.charged("gpu-0") == 100


def test_reserving_baselines_refuse_growth_past_the_reservation_by_name() -> None:
    p = WorstFit(100, final_size={"a": 50})
    with pytest.raises(ValueError, match="no final size for request 'b'"):
        p.allocate("b", 10)
    with pytest.raises(ValueError, match="'a'.*final size 50.*size 60"):
        p.allocate("a", 60)
    p.allocate("a", 20)
    p.update("a", 50)                           # up to the reservation is fine
    with pytest.raises(ValueError, match="'a' grew to 51 B, past the 50 B reserved"):
        p.update("a", 51)
    q = BestFit(100)                            # no final sizes: the allocated size is the reservation
    q.allocate("x", 40)
    with pytest.raises(ValueError, match="past the 40 B reserved"):
        q.update("x", 41)


def test_restart_ablation_admits_at_current_size_and_restarts_the_newest_request_elsewhere() -> None:
    for cls, expect in ((BestFitRestart, "gpu-1"), (WorstFitRestart, "gpu-2")):
        p = cls(100)
        p.allocate("old", 40)
        p.allocate("new", 40)      # both on gpu-0 (80): admitted at current size
        p.allocate("p1", 90)       # gpu-1
        p.allocate("p2", 90)       # gpu-2
        p.update("p1", 50)         # without reservation sizes may be reported down as well as up
        p.update("p2", 30)         # gpu-1 free 50, gpu-2 free 70
        res = p.update("old", 70)  # gpu-0 would hold 110: the newest request is preempted and restarted
        assert res.moves == (Move("new", "gpu-0", expect),), cls.name  # tightest / emptiest that fits
        assert loads(p) == {"gpu-0": 70, "gpu-1": 50, "gpu-2": 30} | {expect: loads(p)[expect]}
        assert p.used(expect) == {"gpu-1": 90, "gpu-2": 70}[expect]
    assert BASELINES["BF-restart"] is BestFitRestart and BASELINES["WF-restart"] is WorstFitRestart
    assert not BestFitRestart.migrates and not BestFit.migrates and LoadBalance.migrates


def test_batch_runs_departs_before_allocates_so_freed_memory_is_reused() -> None:
    p = WorstFit(100)
    p.allocate("a", 60)
    p.allocate("keep", 30)     # gpu-0: 90
    res = p.run_batch([Allocate("b", 60), Depart("a")])
    assert res.placements == {"b": "gpu-0"} and p.active_devices() == ["gpu-0"]
    assert res.moves == () and res.moves_before_dedup == 0


def test_load_balance_opens_a_device_when_no_migration_can_make_room() -> None:
    p = LoadBalance(100, balance_gap=1.0)  # no balancing rounds: isolate de-fragmentation
    p.allocate("a", 60)        # gpu-0: 60
    p.allocate("b", 30)        # gpu-0: 90
    p.allocate("c", 55)        # gpu-1: 55
    p.allocate("e", 20)        # worst fit: gpu-1 -> 75
    res = p.allocate("d", 35)  # free 10 / 25; gpu-1's smallest request (20) fits nowhere else
    assert res.placements == {"d": "gpu-2"} and res.moves == ()


def test_load_balance_sheds_the_smallest_sufficient_request_to_fit_an_arrival() -> None:
    p = LoadBalance(100, balance_gap=1.0)
    p.allocate("a", 70)        # gpu-0: 70
    p.allocate("b", 40)        # gpu-1: 40
    p.allocate("c", 20)        # worst fit: gpu-1 -> 60
    res = p.allocate("d", 50)  # free 30 / 40: gpu-1 moves c (20) to gpu-0 (free 30) and takes d
    assert res.moves == (Move("c", "gpu-1", "gpu-0"),)
    assert res.placements == {"d": "gpu-1"}
    assert loads(p) == {"gpu-0": 90, "gpu-1": 90}


def test_load_balance_migrates_out_of_an_overloaded_device() -> None:
    p = LoadBalance(100, balance_gap=1.0)
    p.allocate("a", 50)
    p.allocate("b", 30)        # gpu-0: 80
    p.allocate("c", 60)        # gpu-1: 60
    res = p.update("a", 65)    # gpu-0: 95 - fine
    assert res.moves == ()
    res = p.update("a", 75)    # gpu-0: 105: the smallest request clearing 5 is b (30) -> gpu-1 (free 40)
    assert res.moves == (Move("b", "gpu-0", "gpu-1"),)
    assert loads(p) == {"gpu-0": 75, "gpu-1": 90}


def test_load_balance_rounds_pair_the_fullest_with_the_emptiest() -> None:
    p = LoadBalance(100, balance_gap=0.1)
    p.allocate("a", 50)        # gpu-0
    p.allocate("b", 40)        # gpu-0: 90
    p.allocate("c", 55)        # gpu-1: 55
    p.allocate("d", 5)         # gpu-1: 60
    p.depart("c")              # gpu-0: 90, gpu-1: 5
    res = p.run_batch([Allocate("e", 5)])  # e -> gpu-1 (10); gap 80: moving b (40) leaves 50 / 50
    assert res.placements == {"e": "gpu-1"}
    assert res.moves == (Move("b", "gpu-0", "gpu-1"),)
    assert loads(p) == {"gpu-0": 50, "gpu-1": 50}
    assert p.run_batch([Depart("e"), Allocate("f", 1)]).moves == ()  # gap 4 < 10: balanced

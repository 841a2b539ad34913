"""Worked examples of MELL's Fig. 10 rules (Allocate / Depart / Update), C = 2400:
L (1200, 2400], M (800, 1200], S (600, 800], T (300, 600], tiny <= 300."""
from __future__ import annotations

import pytest

from shared.policy.mell import MellScheduler, Move, NoCapacity

C = 2400


def test_an_l_arrival_activates_a_gpu_and_pulls_the_m_request_of_the_lightest_m_gpu() -> None:
    s = MellScheduler(C)
    assert s.allocate("m1", 1000).placements == {"m1": "gpu-0"}
    assert s.allocate("m2", 900).placements == {"m2": "gpu-0"}  # the latest M-GPU takes a second M
    assert s.allocate("m3", 850).placements == {"m3": "gpu-1"}  # full: a new M-GPU
    r = s.allocate("big", 1300)
    assert r.placements == {"big": "gpu-2"}
    # gpu-1 (one request) has the highest priority; it empties and is retired
    assert r.moves == (Move("m3", "gpu-1", "gpu-2"),)
    assert s.active_devices() == ["gpu-0", "gpu-2"]
    assert s.theorem1_violations() == []


def test_an_l_arrival_that_takes_from_a_full_m_gpu_refills_it_from_the_latest_m_gpu() -> None:
    s = MellScheduler(C)
    for rid, size in (("m1", 1000), ("m2", 900), ("m3", 1150)):
        s.allocate(rid, size)  # gpu-0: m1 m2, gpu-1: m3
    r = s.allocate("big", 1300)  # room 1100: m3 does not fit; m1 (the larger of gpu-0's) does
    assert r.moves == (Move("m1", "gpu-0", "gpu-2"), Move("m3", "gpu-1", "gpu-0"))
    assert s.requests_on("gpu-0") == {"m2": 900, "m3": 1150}
    assert s.active_devices() == ["gpu-0", "gpu-2"]
    assert s.theorem1_violations() == []


def test_a_t_request_prefers_an_l_gpu_with_room_by_workload_priority() -> None:
    s = MellScheduler(C)
    s.allocate("l1", 1300)
    s.allocate("l2", 1400)
    assert s.allocate("t1", 500).placements == {"t1": "gpu-0"}  # both hold one request: more free memory
    assert s.allocate("t2", 400).placements == {"t2": "gpu-1"}  # fewer requests
    assert s.allocate("t3", 550).placements == {"t3": "gpu-1"}  # a tie (2 requests, 600 free): the more recent
    assert s.allocate("t4", 590).placements == {"t4": "gpu-0"}
    assert s.allocate("t5", 400).placements == {"t5": "gpu-2"}  # no L-GPU has room: a T-GPU


def test_an_m_arrival_joins_an_l_gpu_moving_only_the_t_requests_in_its_way() -> None:
    s = MellScheduler(C)
    s.allocate("l", 1300)
    s.allocate("t1", 500)
    s.allocate("t2", 550)  # gpu-0: 2350 used
    r = s.allocate("m", 1000)  # L + M = 2300 <= C: needs 950 free, so both T go (largest first)
    assert r.placements == {"m": "gpu-0"}
    assert set(r.moves) == {Move("t2", "gpu-0", "gpu-1"), Move("t1", "gpu-0", "gpu-1")}
    s2 = MellScheduler(C)
    for rid, size in (("l", 1300), ("t1", 500), ("t2", 550)):
        s2.allocate(rid, size)
    r2 = s2.allocate("s", 700)  # needs 650 free: moving t2 (550) frees 600 -- not enough; both go
    assert r2.placements == {"s": "gpu-0"} and len(r2.moves) == 2


def test_a_departure_on_a_non_latest_m_gpu_refills_it_from_the_latest_m_gpu() -> None:
    s = MellScheduler(C)
    for rid, size in (("a", 1000), ("b", 900), ("c", 850)):
        s.allocate(rid, size)  # gpu-0: a b; gpu-1 (latest M-GPU): c
    r = s.depart("a")
    assert r.moves == (Move("c", "gpu-1", "gpu-0"),)
    assert s.active_devices() == ["gpu-0"]
    assert s.depart("c").moves == ()  # gpu-0 is now the latest M-GPU: no refill


def test_a_departure_on_a_non_latest_s_gpu_refills_it_from_the_latest_s_gpu() -> None:
    s = MellScheduler(C)
    for i in range(4):
        s.allocate(f"s{i}", 700 - 10 * i)  # gpu-0: s0 s1 s2; gpu-1: s3
    assert s.depart("s1").moves == (Move("s3", "gpu-1", "gpu-0"),)
    assert s.theorem1_violations() == []


def test_an_l_departure_re_allocates_the_rest_of_its_gpu() -> None:
    s = MellScheduler(C)
    s.allocate("l", 1300)
    assert s.allocate("m1", 1000).placements == {"m1": "gpu-0"}  # joins the L-GPU
    assert s.allocate("m2", 900).placements == {"m2": "gpu-1"}
    r = s.depart("l")
    assert r.moves == (Move("m1", "gpu-0", "gpu-1"),)
    assert s.active_devices() == ["gpu-1"]


def test_an_m_departure_from_an_l_gpu_refills_it_with_a_fitting_m_request() -> None:
    s = MellScheduler(C)
    s.allocate("l", 1300)
    s.allocate("m1", 1000)  # on the L-GPU
    s.allocate("m2", 900)  # gpu-1
    s.allocate("m3", 1050)  # gpu-1
    r = s.depart("m1")
    # gpu-1's requests both fit beside the L; the larger that fits (1050 <= 1100) is taken,
    # and gpu-1, the latest M-GPU, is not refilled
    assert r.moves == (Move("m3", "gpu-1", "gpu-0"),)
    assert s.theorem1_violations() == []


def test_m_to_l_growth_on_an_overloaded_m_gpu_moves_the_others_off() -> None:
    s = MellScheduler(C)
    s.allocate("a", 1000)
    s.allocate("b", 900)
    assert s.allocate("t", 450).placements == {"t": "gpu-0"}  # a full M-GPU takes a T
    r = s.update("a", 1400)  # M -> L in place: 400 more, 50 free: the T alone makes room
    assert r.moves == (Move("t", "gpu-0", "gpu-1"),)
    assert s.requests_on("gpu-0") == {"a": 1400, "b": 900}
    r = s.update("a", 1600)  # 200 more, 100 free: the M goes (moving the T back would not be enough)
    # gpu-0 is then an L-GPU under 75% while a T-GPU exists (property 5): it takes the T back
    assert r.moves == (Move("b", "gpu-0", "gpu-2"), Move("t", "gpu-1", "gpu-0"))
    assert s.requests_on("gpu-0") == {"a": 1600, "t": 450}
    assert s.active_devices() == ["gpu-0", "gpu-2"]


def test_m_to_l_growth_on_an_l_gpu_moves_the_request_itself() -> None:
    s = MellScheduler(C)
    s.allocate("l", 1300)
    s.allocate("m", 1000)  # on the L-GPU
    r = s.update("m", 1250)
    assert r.moves == (Move("m", "gpu-0", "gpu-1"),)


def test_t_to_s_updates_depart_and_re_allocate_by_the_s_rule() -> None:
    s = MellScheduler(C)
    s.allocate("l", 1300)
    s.allocate("m", 1000)  # gpu-0: L + M, 100 free
    s.allocate("t1", 550)
    s.allocate("t2", 500)  # both on the T-GPU gpu-1
    assert s.update("t1", 700).moves == (Move("t1", "gpu-1", "gpu-2"),)  # an S: a new S-GPU
    assert s.update("t2", 650).moves == (Move("t2", "gpu-1", "gpu-2"),)  # the latest S-GPU has room
    assert s.active_devices() == ["gpu-0", "gpu-2"]


def test_tiny_requests_share_a_multi_item_that_moves_as_its_requests() -> None:
    s = MellScheduler(C)
    for i in range(5):
        s.allocate(f"x{i}", 100)  # one multi-item of (C/8, C/4] = (300, 600]: 500
    assert s.active_devices() == ["gpu-0"] and s.used("gpu-0") == 500
    r = s.allocate("l", 1300)  # a new L-GPU under 75% pulls the T-GPU's multi-item: 5 migrations
    assert set(r.moves) == {Move(f"x{i}", "gpu-0", "gpu-1") for i in range(5)} and len(r.moves) == 5
    assert s.update("x0", 700).moves == ()  # tiny -> S: leaves the bundle; the S rule picks this L-GPU
    assert s.requests_on("gpu-1")["x0"] == 700 and s.used("gpu-1") == 2400
    assert s.depart("x1").moves == () and s.used("gpu-1") == 2300
    s.allocate("y", 250)  # tiny: joins the multi-item (300 + 250 <= 600) but gpu-1 has 100 free
    assert s.device_of("y") == "gpu-2"


def test_the_migration_cap_stops_moving_and_a_later_operation_repairs() -> None:
    s = MellScheduler(C, max_migrations_per_op=1)
    for rid, size in (("m1", 1000), ("m2", 900), ("m3", 1150)):
        s.allocate(rid, size)
    r = s.allocate("big", 1300)  # would move m1 then refill gpu-0 with m3: only the first fits the cap
    assert r.moves == (Move("m1", "gpu-0", "gpu-2"),)
    assert s.capped_operations == 1
    assert any("property 1" in v for v in s.theorem1_violations())
    r = s.allocate("x", 50)  # the next op spends its unused budget on the cut-short refill
    assert Move("m3", "gpu-1", "gpu-0") in r.moves
    assert s.theorem1_violations() == []


def test_a_fixed_device_list_activates_in_order_and_raises_no_capacity() -> None:
    s = MellScheduler(C, ["a", "b"])
    assert s.allocate("l1", 1300).placements == {"l1": "a"}
    assert s.allocate("l2", 1400).placements == {"l2": "b"}
    with pytest.raises(NoCapacity, match="'l3' of size 1500"):
        s.allocate("l3", 1500)
    assert s.device_of("l3") is None and s.active_devices() == ["a", "b"]
    assert s.allocate("l4", 1000).placements == {"l4": "a"}  # an M still fits beside l1
    s.depart("l1")
    s.depart("l4")
    assert s.allocate("l5", 1500).placements == {"l5": "a"}  # a retired device is reused


def test_bad_input_is_refused_with_a_clear_error() -> None:
    s = MellScheduler(C)
    s.allocate("r", 100)
    with pytest.raises(ValueError, match="'r' is already allocated"):
        s.allocate("r", 100)
    with pytest.raises(KeyError, match="'nope' is not allocated"):
        s.depart("nope")
    with pytest.raises(ValueError, match="2401 is outside"):
        s.update("r", C + 1)
    with pytest.raises(ValueError, match="capacity"):
        MellScheduler(4)

"""MELL's placement hints from constructed views: per size class, the worker MELL would allocate a new
request to now, through MellPolicy and PlannerCore, and a request routed by them needs no migration."""
from __future__ import annotations

from dataclasses import replace

import msgspec
from views import BLOCK, BLOCKS, view, worker

from shared.events.plan import Migrate, PlacementHints
from shared.planner import PlannerCore
from shared.planner.mell_hints import class_bounds
from shared.planner.mell_policy import MellPolicy
from shared.policy.mell import request_class

C = BLOCKS * BLOCK  # with kv_high_watermark = 1, MELL's capacity is an instance's whole KV


def by_class(hints: PlacementHints) -> dict[str, tuple[str | None, int]]:
    return {e.request_class: (e.worker_id, e.room_bytes) for e in hints.entries}


def test_class_bounds_partition_the_sizes_as_request_class_does() -> None:
    bounds = class_bounds(C)
    assert [name for name, _, _ in bounds] == ["tiny", "T", "S", "M", "L"]
    assert bounds[0][1] == 0 and bounds[-1][2] == C
    for (_, _, hi), (_, lo, _) in zip(bounds, bounds[1:]):
        assert hi == lo  # contiguous: every size in (0, C] has exactly one class
    for name, lo, hi in bounds:
        assert request_class(lo + 1, C) == name and request_class(hi, C) == name
    assert [name for name, _, _ in class_bounds(8)] == ["tiny", "T", "M", "L"]  # S is empty when C = 8


def test_hints_follow_mells_allocate_for_each_class() -> None:
    core = PlannerCore([MellPolicy(kv_high_watermark=1.0)])
    v = replace(view(10.0, worker("w0", {"big": 60}), worker("w1"), worker("w2")), interval_s=2.0)
    assert core.placement_hints(v) == []  # MELL has not seen the cluster yet: no hints, route by load
    assert [a for e in core.step(v) for a in e.actions if isinstance(a, Migrate)] == []
    (hints,) = core.placement_hints(v)
    assert hints.model == "m" and hints.capacity_bytes == C and hints.ts == 10.0
    assert hints.valid_until == 10.0 + 3 * 2.0  # three planning intervals
    got = by_class(hints)
    # M, S, T and tiny join the L-request's device (S_L + S_i <= C); another L activates the next idle worker
    assert got["M"] == ("w0", C - 60 * BLOCK)
    assert got["S"] == ("w0", C - 60 * BLOCK)
    assert got["tiny"] == ("w0", C - 60 * BLOCK)
    assert got["L"] == ("w1", C)
    assert msgspec.json.decode(msgspec.json.encode(hints), type=PlacementHints) == hints  # a valid wire message


def test_a_request_placed_where_the_hint_said_is_not_migrated() -> None:
    core = PlannerCore([MellPolicy(kv_high_watermark=1.0)])
    v = view(0.0, worker("w0", {"big": 60}), worker("w1"), worker("w2"))
    core.step(v)
    target, _ = by_class(core.placement_hints(v)[0])["M"]
    placed = {"w0": {"big": 60}, "w1": {}, "w2": {}}
    placed[target]["mid"] = 40  # an M request (40 of 100 blocks) goes where the hint said
    v2 = view(1.0, *(worker(w, reqs) for w, reqs in placed.items()))
    assert [a for e in core.step(v2) for a in e.actions if isinstance(a, Migrate)] == []
    # routed elsewhere (least load would pick an empty worker), MELL moves it to w0
    core2 = PlannerCore([MellPolicy(kv_high_watermark=1.0)])
    core2.step(v)
    v3 = view(1.0, worker("w0", {"big": 60}), worker("w1", {"mid": 40}), worker("w2"))
    moves = [a for e in core2.step(v3) for a in e.actions if isinstance(a, Migrate)]
    assert [(m.request_id, m.source, m.destination) for m in moves] == [("mid", "w1", "w0")]


def test_no_hints_when_the_workers_changed_or_the_core_is_disabled() -> None:
    core = PlannerCore([MellPolicy(kv_high_watermark=1.0)])
    core.step(view(0.0, worker("w0", {"big": 60}), worker("w1")))
    changed = view(1.0, worker("w0", {"big": 60}), worker("w1"), worker("w2"))
    assert core.placement_hints(changed) == []  # MELL's devices are not the view's: wait for the next step
    core.step(changed)
    assert len(core.placement_hints(changed)) == 1
    off = PlannerCore([MellPolicy()], enabled=False)
    off.step(changed)
    assert off.placement_hints(changed) == []

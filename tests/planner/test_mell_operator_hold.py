"""An operator's move is not undone by the planner (issue 37 item 3): a request that shows up on another
worker without a plan of this planner's (an operator's or an external scheduler's MigrateOut) stays
there for `OPERATOR_HOLD_S`; without the hold MELL moves it straight back to where it had placed it."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from test_mell_policy import apply_moves, fragmented, migrations, run

from shared.events.plan import Migrate
from shared.planner import ClusterView, PlannerCore
from shared.planner.mell_policy import OPERATOR_HOLD_S, MellPolicy


def settled(core: PlannerCore) -> ClusterView:
    """A cluster MELL has consolidated and left alone for an interval."""
    _, v = run(core, fragmented())
    second, v = run(core, replace(v, now=1.0))
    assert migrations(second) == []
    return v


def operator_moves(v: ClusterView, now: float) -> tuple[ClusterView, str, str, str]:
    """An operator moves one request to a worker MELL emptied: (the view after, request, from, to)."""
    source = next(w for w in sorted(v.workers) if v.workers[w].requests)
    rid = v.workers[source].instances[0].requests[0].request_id
    destination = next(w for w in sorted(v.workers) if not v.workers[w].requests)
    move = Migrate(request_id=rid, source=source, destination=destination,
                   destination_instance=v.workers[destination].instances[0].instance_id, mode="kv")
    return apply_moves(v, [SimpleNamespace(actions=[move])], now), rid, source, destination  # type: ignore[list-item]


def moves_of(effects, rid: str) -> list[Migrate]:  # type: ignore[no-untyped-def]
    return [m for m in migrations(effects) if m.request_id == rid]


def test_an_operator_move_is_held_for_the_stated_time_then_mell_may_place_it_again() -> None:
    core = PlannerCore([MellPolicy()])
    v, rid, source, destination = operator_moves(settled(core), now=2.0)
    assert v.location(rid)[0] == destination  # type: ignore[index]
    for now in (2.0, 3.0, 2.0 + OPERATOR_HOLD_S / 2, 2.0 + OPERATOR_HOLD_S - 1.0):
        effects, v = run(core, replace(v, now=now))
        assert moves_of(effects, rid) == [], now  # left where the operator put it
    effects, _ = run(core, replace(v, now=2.0 + OPERATOR_HOLD_S + 1.0))
    assert [(m.source, m.destination) for m in moves_of(effects, rid)] == [(destination, source)]


def test_without_the_hold_the_planner_moves_it_straight_back() -> None:
    core = PlannerCore([MellPolicy(operator_hold_s=0.0)])
    v, rid, source, destination = operator_moves(settled(core), now=2.0)
    effects, _ = run(core, replace(v, now=2.0))
    assert [(m.source, m.destination) for m in moves_of(effects, rid)] == [(destination, source)]


def test_the_planners_own_moves_are_not_held() -> None:
    policy = MellPolicy()
    core = PlannerCore([policy])
    _, v = run(core, fragmented())
    run(core, replace(v, now=1.0))
    assert policy.held_until == {}

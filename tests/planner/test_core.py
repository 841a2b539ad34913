"""PlannerCore with a scripted policy: dedupe, expiry, staleness, outcomes, disabled, lease-loss cancel."""
from __future__ import annotations

from views import view, worker

from shared.events.plan import Migrate, PlanApplied, PlanCancelled, PlanDecided, PlanFailed, ReportIdle
from shared.planner import Busy, ClusterView, Decision, PlannerCore, ctl_commands
from shared.events.ctl import MigrateOut
from shared.wire import encode


class Scripted:
    """Decides the same migration of r1 (w0 -> w1) every step; records what it hears back."""

    name = "scripted"

    def __init__(self, *actions) -> None:
        self.actions = actions or (Migrate(request_id="r1", source="w0", destination="w1",
                                           destination_instance="w1-m", mode="tokens"),)
        self.calls = 0
        self.outcomes: list[tuple[str, type]] = []
        self.busy_seen: list[bool] = []

    def decide(self, v: ClusterView, busy: Busy) -> list[Decision]:
        self.calls += 1
        self.busy_seen.append(busy.request("r1"))
        return [Decision(action=a, trigger="fragmentation", reason="test") for a in self.actions]

    def on_outcome(self, effect, outcome) -> None:
        self.outcomes.append((effect.plan_id, type(outcome)))


def cluster(now: float, *, r1_on: str = "w0", w1_alive: bool = True) -> ClusterView:
    return view(now, worker("w0", {"r1": 5} if r1_on == "w0" else {}),
                worker("w1", {"r1": 5} if r1_on == "w1" else {}, alive=w1_alive))


def test_an_effect_in_flight_is_not_decided_again_until_it_ends() -> None:
    policy = Scripted()
    core = PlannerCore([policy], id_prefix="t")
    first = core.step(cluster(0.0))
    assert len(first) == 1 and first[0].plan_id == "t-1"
    assert isinstance(first[0].actions[0], Migrate)
    assert core.dispatched("t-1", cluster(0.1)) is None
    assert core.step(cluster(1.0)) == [] and policy.busy_seen == [False, True]
    assert core.counts["suppressed"] == 1
    assert core.on_outcome(PlanApplied(plan_id="t-1", ts=2.0, duration_s=1.0)) is first[0]
    again = core.step(cluster(3.0))
    assert [e.plan_id for e in again] == ["t-2"]  # the key is free again: a new effect with a new id
    assert policy.outcomes == [("t-1", PlanApplied)]


def test_an_outcome_closes_an_effect_once_and_late_ones_are_ignored() -> None:
    core = PlannerCore([Scripted()])
    (effect,) = core.step(cluster(0.0))
    assert core.on_outcome(PlanFailed(plan_id=effect.plan_id, ts=1.0, action_index=0, message="refused")) is effect
    assert core.on_outcome(PlanApplied(plan_id=effect.plan_id, ts=1.5, duration_s=1.0)) is None
    assert core.on_outcome(PlanApplied(plan_id="nobody", ts=1.5, duration_s=1.0)) is None
    assert core.counts["failed"] == 1 and core.counts["late"] == 2 and core.counts["applied"] == 0


def test_an_effect_whose_outcome_never_comes_expires_as_failed() -> None:
    core = PlannerCore([Scripted()], default_ttl_s=10.0)
    (effect,) = core.step(cluster(0.0))
    core.dispatched(effect.plan_id)
    assert core.step(cluster(9.0)) == [] and core.take_closed() == []
    renewed = core.step(cluster(10.0))  # expired at 10: closed, and the policy may decide it again
    (closed,) = core.take_closed()
    assert isinstance(closed, PlanFailed) and closed.plan_id == effect.plan_id and "expired" in closed.message
    assert len(renewed) == 1 and renewed[0].plan_id != effect.plan_id
    assert core.on_outcome(PlanApplied(plan_id=effect.plan_id, ts=11.0, duration_s=1.0)) is None


def test_stale_effects_are_cancelled_before_they_are_applied() -> None:
    core = PlannerCore([Scripted()])
    (effect,) = core.step(cluster(0.0))
    assert core.dispatched(effect.plan_id, cluster(0.5, w1_alive=False)) == "worker w1 is dead or unknown"
    (closed,) = core.take_closed()
    assert isinstance(closed, PlanCancelled) and "w1 is dead" in closed.message
    assert core.dispatched(effect.plan_id) == f"effect {effect.plan_id} is not in flight"

    (moved,) = core.step(cluster(1.0))  # decided again; by the next step it already runs elsewhere
    (again,) = core.step(view(2.0, worker("w0"), worker("w1", {"r1": 5})))  # (the scripted policy insists)
    (closed,) = core.take_closed()
    assert closed.plan_id == moved.plan_id and "already on w1" in closed.message
    core.step(view(3.0, worker("w0"), worker("w1")))
    (closed,) = core.take_closed()
    assert closed.plan_id == again.plan_id and "no longer running" in closed.message
    assert core.counts["cancelled"] == 3


def test_a_dispatched_effect_is_not_cancelled_by_a_view_that_lags_behind_it() -> None:
    core = PlannerCore([Scripted()])
    (effect,) = core.step(cluster(0.0))
    assert core.dispatched(effect.plan_id, cluster(0.0)) is None
    core.step(view(1.0, worker("w0"), worker("w1")))  # mid hand-over: the request is nowhere for a moment
    assert core.take_closed() == [] and effect.plan_id in core.inflight


def test_a_disabled_core_decides_nothing() -> None:
    policy = Scripted()
    core = PlannerCore([policy], enabled=False)
    assert core.step(cluster(0.0)) == [] and policy.calls == 0 and core.counts["decided"] == 0


def test_losing_the_lease_cancels_what_was_not_dispatched() -> None:
    idle = ReportIdle(worker_id="w1", since_ts=0.0)
    core = PlannerCore([Scripted(Migrate(request_id="r1", source="w0", destination="w1", destination_instance="w1-m"),
                                 idle)])
    a, b = core.step(cluster(0.0))
    core.dispatched(a.plan_id)
    (cancelled,) = core.cancel_all(1.0, "lease lost")
    assert cancelled.plan_id == b.plan_id and list(core.inflight) == [a.plan_id]


def test_effects_are_publishable_and_carry_their_ctl_commands() -> None:
    (effect,) = PlannerCore([Scripted()], id_prefix="p7").step(cluster(5.0))
    assert encode(PlanDecided(plan=effect))  # a valid wire message as it is
    ((worker_id, command),) = ctl_commands(effect)
    assert worker_id == "w0" and isinstance(command, MigrateOut)
    assert command.plan_id == "p7-1" and command.idempotency_key == "p7-1:0" and command.mode == "tokens"
    assert command.destination == "w1" and command.destination_instance == "w1-m"

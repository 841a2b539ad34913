"""Applying effects against a real nats-server: a worker nobody serves, a ctl that refuses, a report
that needs no command — each a typed outcome and a counter, never an exception."""
from __future__ import annotations

import time

from shared.bus import Bus, BusSettings, Delivery
from shared.events.ctl import CtlRefused, MigrateOut
from shared.events.plan import Migrate, PlanApplied, PlanCancelled, PlanFailed, ReportIdle
from shared.metrics import sample_value
from shared.planner import Decision, make_effect
from shared.subjects import worker_ctl

from services.planner.apply import apply_effect


def migrate(source: str) -> Decision:
    return Decision(action=Migrate(request_id="gone", source=source, destination="w1", destination_instance="w1-m",
                                   mode="tokens"), trigger="fragmentation")


async def test_effects_end_in_typed_outcomes(nats_url: str) -> None:
    bus = await Bus.connect(BusSettings(url=nats_url), service="planner")
    try:
        unreachable = sample_value("tidal_planner_skipped_total", {"reason": "unreachable"})
        nobody = await apply_effect(bus, make_effect("e-1", migrate("nobody"), 1.0), timeout_s=1.0)
        assert isinstance(nobody, PlanFailed) and "MigrateOut to nobody got no answer" in nobody.message
        assert sample_value("tidal_planner_skipped_total", {"reason": "unreachable"}) == unreachable + 1

        async def refuse(msg: MigrateOut, _ctx: Delivery) -> CtlRefused:
            assert msg.plan_id == "e-2" and msg.idempotency_key == "e-2:0"
            assert msg.deadline_ts is not None and time.time() < msg.deadline_ts <= time.time() + 2.0  # ctl timeout
            return CtlRefused(idempotency_key=msg.idempotency_key, command="MigrateOut", worker_id="w0",
                              code="not_found", message=f"request {msg.request_id} is not running on w0")

        await bus.subscribe(worker_ctl("w0"), MigrateOut, refuse)
        refused = await apply_effect(bus, make_effect("e-2", migrate("w0"), 1.0), timeout_s=2.0)
        # the request ended or moved since the view it was decided on: stale, not a failure
        assert isinstance(refused, PlanCancelled) and refused.message.startswith("stale: ")
        assert "(not_found)" in refused.message and "gone" in refused.message
        assert sample_value("tidal_planner_migrations_total", {"mode": "tokens", "outcome": "stale"}) >= 1

        idle = make_effect("e-3", Decision(action=ReportIdle(worker_id="w2", since_ts=1.0), trigger="idle"), 1.0)
        assert isinstance(await apply_effect(bus, idle, timeout_s=1.0), PlanApplied)
    finally:
        await bus.close()


async def test_a_migration_whose_source_dies_unanswered_fails_at_once(nats_url: str) -> None:
    """The source took the MigrateOut and died: no answer will come. The effect ends as soon as the
    registry says so (dead, or another incarnation), not at the command's deadline."""
    bus = await Bus.connect(BusSettings(url=nats_url), service="planner")
    try:
        async def silent(_msg: MigrateOut, _ctx: Delivery) -> None:
            return None  # received, never answered: the process is gone

        await bus.subscribe(worker_ctl("w-dies"), MigrateOut, silent)
        await bus.subscribe(worker_ctl("w-restarts"), MigrateOut, silent)
        asked: list[str] = []

        def liveness(worker: str) -> str | None:
            asked.append(worker)
            if len(asked) < 3:
                return "inc-1"
            return None if worker == "w-dies" else "inc-2"

        died = await apply_effect(bus, make_effect("e-4", migrate("w-dies"), 1.0), timeout_s=60.0, worker_lost=liveness)
        assert isinstance(died, PlanFailed) and "w-dies died before answering" in died.message, died
        asked.clear()
        again = await apply_effect(bus, make_effect("e-5", migrate("w-restarts"), 1.0), timeout_s=60.0,
                                   worker_lost=liveness)
        assert isinstance(again, PlanFailed) and "restarted before answering (inc-1 -> inc-2)" in again.message
        assert sample_value("tidal_planner_skipped_total", {"reason": "source_lost"}) >= 2
    finally:
        await bus.close()

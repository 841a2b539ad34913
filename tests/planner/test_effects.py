"""Effects to ctl commands: the memory arbiter's ReleaseAdapter frees an adapter's device copy only."""
from __future__ import annotations

from shared.events.ctl import CtlCommand, CtlRequest, EvictAdapter, OffloadAdapter
from shared.events.plan import PlanDecided, ReleaseAdapter
from shared.planner import Decision, ctl_commands
from shared.planner.effects import key, make_effect
from shared.wire import decode, encode


def test_release_adapter_offloads_the_device_copy_and_never_unregisters() -> None:
    effect = make_effect("arb-3", Decision(action=ReleaseAdapter(worker_id="w1", adapter="cold"),
                                           trigger="kv_pressure", freed_bytes=1 << 20), now=10.0)
    ((worker_id, command),) = ctl_commands(effect)
    assert worker_id == "w1"
    assert type(command) is OffloadAdapter and not isinstance(command, EvictAdapter)
    assert command.adapter == "cold" and command.plan_id == "arb-3" and command.idempotency_key == "arb-3:0"
    assert key(effect.actions[0]) == ("adapter", "w1/cold")
    # what the planner publishes and sends is a valid wire message, and decodes as the ctl union
    assert decode(encode(PlanDecided(plan=effect)), PlanDecided).plan == effect
    assert decode(encode(command), CtlRequest) == command
    assert isinstance(command, CtlCommand)

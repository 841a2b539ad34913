"""Effects: what the planner decides, as publishable plan messages, and the ctl commands that apply them.

An effect is a `shared.events.plan.Plan` with exactly one action; its `plan_id` is the effect id
(stable: the same id on its decided, applied/failed/cancelled events and in the idempotency key of
every ctl command it sends). Publishing an effect is `PlanDecided(plan=effect)`.

Each effect has a *key* naming what it acts on (a request, a worker's idleness, a group, an
instance): the core never has two effects with one key in flight.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shared.events.common import GroupMember
from shared.events.ctl import (
    CtlCommand, DropLayers, EvictModel, EvictPrefixBlocks, JoinGroup, LeaveGroup, LoadModel, MigrateOut, OffloadAdapter, Prewarm,
    RestoreLayers,
)
from shared.events.plan import (
    DissolveGroup, DropInstanceLayers, FormGroup, Migrate, PlacePrewarm, Plan, PlanAction, PlanTrigger,
    ReleaseAdapter, ReleasePrefixBlocks, ReleasePrewarm, ReportIdle, RestoreInstanceLayers, ScaleDown, ScaleUp,
)

Effect = Plan  # one action; plan_id is the effect id
EffectKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Decision:
    """What a policy returns: an action, why, and how long its outcome may take to come back."""

    action: PlanAction
    trigger: PlanTrigger
    reason: str = ""
    freed_bytes: int = 0  # device memory it is expected to make available
    modeled_cost: float = 0.0
    ttl_s: float | None = None  # None: the core's default


def kind(action: PlanAction) -> str:
    """The action's wire tag (`migrate`, `report_idle`, ...): the `kind` label of plan metrics."""
    return type(action).__struct_config__.tag  # type: ignore[return-value]


def effect_kind(effect: Effect) -> str:
    return kind(effect.actions[0])


def action_of(effect: Effect) -> PlanAction:
    return effect.actions[0]


def key(action: PlanAction) -> EffectKey:
    """What the action acts on; two in-flight effects never share a key."""
    match action:
        case Migrate():
            return ("request", action.request_id)
        case ReportIdle():
            return ("idle", action.worker_id)
        case FormGroup() | DissolveGroup():
            return ("group", action.group_id)
        case DropInstanceLayers() | RestoreInstanceLayers():
            return ("instance", action.instance_id)
        case ScaleUp() | ScaleDown():
            return ("instance", action.instance_id)
        case PlacePrewarm() | ReleasePrewarm():
            return ("prewarm", f"{action.worker_id}/{action.model}")
        case ReleaseAdapter():
            return ("adapter", f"{action.worker_id}/{action.adapter}")
        case ReleasePrefixBlocks():
            return ("prefix", f"{action.worker_id}/{action.instance_id}")
    raise TypeError(f"not a plan action: {type(action).__name__}")


def workers_of(action: PlanAction) -> tuple[str, ...]:
    """The workers an action needs alive (a dead one makes a decided effect stale)."""
    match action:
        case Migrate():
            return (action.source, action.destination)
        case FormGroup():
            return tuple(m.worker_id for m in action.members)
        case DissolveGroup():
            return ()
    worker = getattr(action, "worker_id", None)
    return (worker,) if worker else ()


def make_effect(effect_id: str, decision: Decision, now: float) -> Effect:
    return Plan(plan_id=effect_id, ts=now, trigger=decision.trigger, reason=decision.reason[:2000],
                actions=[decision.action], freed_bytes=max(0, int(decision.freed_bytes)),
                modeled_cost=max(0.0, decision.modeled_cost))


def ctl_commands(effect: Effect, *, group_members: Sequence[GroupMember] | None = None) -> list[tuple[str, CtlCommand]]:
    """(worker_id, command) to send, in order, to apply an effect; [] when it needs none (ReportIdle).

    Idempotency keys are `<effect id>:<n>`, so a retried effect is applied once by each worker.
    DissolveGroup names only the group: its members come from the group's registry record
    (`group_members`; LeaveGroup to each). Raises ValueError for a DissolveGroup without them, and
    for an action no ctl command implements yet (a ScaleDown without its `model`).
    """
    action, pid = effect.actions[0], effect.plan_id

    def k(n: int) -> dict[str, str]:
        return {"idempotency_key": f"{pid}:{n}", "plan_id": pid}

    match action:
        case Migrate():
            return [(action.source, MigrateOut(**k(0), request_id=action.request_id, destination=action.destination,
                                               destination_instance=action.destination_instance, mode=action.mode))]
        case ReportIdle():
            return []
        case DropInstanceLayers():
            return [(action.worker_id, DropLayers(**k(0), instance_id=action.instance_id, group_id=action.group_id,
                                                  layers=action.layers))]
        case RestoreInstanceLayers():
            return [(action.worker_id, RestoreLayers(**k(0), instance_id=action.instance_id, layers=action.layers,
                                                     peer=action.peer))]
        case FormGroup():
            return [(m.worker_id, JoinGroup(**k(n), group_id=action.group_id, instance_id=m.instance_id,
                                            members=action.members)) for n, m in enumerate(action.members)]
        case DissolveGroup():
            if group_members is None:
                raise ValueError(f"DissolveGroup {action.group_id} ({pid}) needs the group's members (its registry record)")
            return [(m.worker_id, LeaveGroup(**k(n), group_id=action.group_id, instance_id=m.instance_id))
                    for n, m in enumerate(group_members)]
        case PlacePrewarm():
            return [(action.worker_id, Prewarm(**k(0), model=action.model, layers=action.layers,
                                               cap_instance_id=action.cap_instance_id,
                                               kv_cap_bytes=action.kv_cap_bytes))]
        case ReleasePrewarm():
            return [(action.worker_id, EvictModel(**k(0), model=action.model))]
        case ReleaseAdapter():  # the device copy only: the adapter stays registered and servable
            return [(action.worker_id, OffloadAdapter(**k(0), adapter=action.adapter))]
        case ReleasePrefixBlocks():  # cached-free prefix blocks, least recently used first
            return [(action.worker_id, EvictPrefixBlocks(**k(0), instance_id=action.instance_id, blocks=action.blocks))]
        case ScaleUp():
            return [(action.worker_id, LoadModel(**k(0), model=action.model, instance_id=action.instance_id))]
        case ScaleDown() if action.model is not None:  # drain: its requests finish, its weights stay warm
            return [(action.worker_id, EvictModel(**k(0), model=action.model, instance_id=action.instance_id))]
    raise ValueError(f"no ctl command applies a {type(action).__name__} effect ({pid})")


__all__ = [
    "Decision", "Effect", "EffectKey", "action_of", "ctl_commands", "effect_kind", "key", "kind", "make_effect",
    "workers_of",
]

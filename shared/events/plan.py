"""Family `plan`: the planner's decisions, published for dashboards and external schedulers.

Subjects: `tidal.v1.evt.plan.<kind>` (pub/sub; kind = decided | applied | failed) and
`tidal.v1.planner.capacity` (request/reply, queue group `planner`: the dispatcher asks for
capacity it does not have). A plan is a list of actions; the planner carries each out with
control commands (family `ctl`) that carry the plan's id. Provisional: later issues (buddy
groups, MELL migration, WarmServe prewarming) add actions and fields.
"""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    AdapterName, ByteCount, Count, GroupId, InstanceId, Message, ModelName, PlanId, Reason, RequestId, Seconds,
    ServiceId, Timestamp, Value, WorkerId,
)
from shared.events.common import GroupMember, LayerRange
from shared.events.ctl import MigrationMode


# --- actions (tagged: a plan's actions are a union) ---
class FormGroup(Message, kw_only=True):
    """Instances of `model` form buddy group `group_id`, each keeping its members' `layers` (KunServe)."""

    group_id: GroupId
    model: ModelName
    members: Annotated[list[GroupMember], Meta(min_length=2, max_length=64)]


class DissolveGroup(Message, kw_only=True):
    """Restore every member's dropped layers and run them as independent instances again."""

    group_id: GroupId


class Migrate(Message, kw_only=True):
    """Move a running request to another instance (MELL), by KV or by tokens."""

    request_id: RequestId
    source: WorkerId
    destination: WorkerId
    destination_instance: InstanceId
    mode: MigrationMode = "kv"


class PlacePrewarm(Message, kw_only=True):
    """Load `model`'s first `layers` on a worker's unused KV space ahead of demand (WarmServe)."""

    worker_id: WorkerId
    model: ModelName
    layers: LayerRange


class ReleasePrewarm(Message, kw_only=True):
    worker_id: WorkerId
    model: ModelName


class ReleaseAdapter(Message, kw_only=True):
    worker_id: WorkerId
    adapter: AdapterName


class ScaleUp(Message, kw_only=True):
    """Start a new instance of `model` on `worker_id` (ideally one that has prewarmed it)."""

    model: ModelName
    worker_id: WorkerId
    instance_id: InstanceId


class ScaleDown(Message, kw_only=True):
    instance_id: InstanceId
    worker_id: WorkerId


PlanAction = FormGroup | DissolveGroup | Migrate | PlacePrewarm | ReleasePrewarm | ReleaseAdapter | ScaleUp | ScaleDown

PlanTrigger = Literal["kv_pressure", "fragmentation", "forecast", "idle", "capacity_request", "manual"]


class Plan(Value, kw_only=True):
    plan_id: PlanId
    ts: Timestamp  # when it was decided
    trigger: PlanTrigger
    reason: Reason = ""
    actions: Annotated[list[PlanAction], Meta(max_length=1024)] = []
    freed_bytes: ByteCount = 0  # device memory the plan is expected to make available
    modeled_cost: Annotated[float, Meta(ge=0)] = 0.0  # the planner's cost model, arbitrary units


# --- events on tidal.v1.evt.plan.<kind> ---
class PlanDecided(Message, kw_only=True):
    plan: Plan


class PlanApplied(Message, kw_only=True):
    plan_id: PlanId
    ts: Timestamp
    duration_s: Seconds
    commands: Count = 0  # control commands sent


class PlanFailed(Message, kw_only=True):
    """A plan stopped at `action_index`; actions before it were applied (and stay applied)."""

    plan_id: PlanId
    ts: Timestamp
    action_index: Count
    message: Reason


PlanEvent = PlanDecided | PlanApplied | PlanFailed
PLAN_EVENT_KINDS: dict[str, type] = {"decided": PlanDecided, "applied": PlanApplied, "failed": PlanFailed}


# --- tidal.v1.planner.capacity ---
class CapacityRequest(Message, kw_only=True):
    """The dispatcher has requests for `model` that no live instance can take."""

    dispatcher_id: ServiceId
    model: ModelName
    adapter: AdapterName | None = None
    queued_requests: Count
    queued_prompt_tokens: Count = 0
    ts: Timestamp


class CapacityReply(Message, kw_only=True):
    """`planned`: a plan (plan_id) will add capacity; `none`: nothing can be done now."""

    model: ModelName
    outcome: Literal["planned", "none"]
    plan_id: PlanId | None = None
    retry_after_s: Seconds | None = None


__all__ = [
    "CapacityReply",
    "CapacityRequest",
    "DissolveGroup",
    "FormGroup",
    "Migrate",
    "PLAN_EVENT_KINDS",
    "PlacePrewarm",
    "Plan",
    "PlanAction",
    "PlanApplied",
    "PlanDecided",
    "PlanEvent",
    "PlanFailed",
    "PlanTrigger",
    "ReleaseAdapter",
    "ReleasePrewarm",
    "ScaleDown",
    "ScaleUp",
]

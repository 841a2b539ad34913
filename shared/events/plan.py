"""Family `plan`: the planner's decisions, published for dashboards and external schedulers.

Subjects: `tidal.v1.evt.plan.<kind>` (pub/sub; kind = decided | applied | failed | cancelled),
`tidal.v1.evt.planner.placement` (pub/sub: `PlacementHints`, the dispatcher's `mell` routing) and
`tidal.v1.planner.capacity` (request/reply, queue group `planner`: the dispatcher asks for
capacity it does not have). A plan is a list of actions; the planner carries each out with
control commands (family `ctl`) that carry the plan's id. The built-in planner (shared/planner)
decides one action per plan (an *effect*, plan_id = its effect id) and closes every plan it
published with exactly one of applied, failed or cancelled. Provisional: later issues (buddy
groups, WarmServe prewarming) add actions and fields.
"""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    AdapterName, ByteCount, Count, GroupId, InstanceId, Message, ModelName, PlanId, Reason, RequestId, Seconds,
    ServiceId, Timestamp, Value, WorkerId,
)
from shared.events.common import GroupMember, LayerRange
from shared.events.ctl import CtlRefusedCode, MigrationMode


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


class DropInstanceLayers(Message, kw_only=True):
    """An instance in buddy group `group_id` releases the weights of `layers` (ctl DropLayers)."""

    worker_id: WorkerId
    instance_id: InstanceId
    group_id: GroupId
    layers: LayerRange


class RestoreInstanceLayers(Message, kw_only=True):
    """An instance loads `layers` back, from its host copy or from `peer` (ctl RestoreLayers)."""

    worker_id: WorkerId
    instance_id: InstanceId
    layers: LayerRange
    peer: WorkerId | None = None


class ReportIdle(Message, kw_only=True):
    """`worker_id` holds no request any more (MELL terminates such a GPU): a candidate for scale-down,
    prewarming or another model. Carries no control command; applied as soon as it is published."""

    worker_id: WorkerId
    since_ts: Timestamp


class PlacePrewarm(Message, kw_only=True):
    """Load `model`'s first `layers` on a worker's unused KV space ahead of demand (WarmServe).
    Proactive prewarming (§4.1) into a grace-period instance's KV surplus also caps that instance's
    KV at its reservation target (Eq. 1): `cap_instance_id`, `kv_cap_bytes`."""

    worker_id: WorkerId
    model: ModelName
    layers: LayerRange
    cap_instance_id: InstanceId | None = None
    kv_cap_bytes: ByteCount | None = None


class ReleasePrewarm(Message, kw_only=True):
    worker_id: WorkerId
    model: ModelName


class ReleaseAdapter(Message, kw_only=True):
    """Free `adapter`'s device copy on `worker_id` (ctl `OffloadAdapter`); it stays servable: still
    registered, its host copy kept, reloaded by the next request naming it (a cold start)."""

    worker_id: WorkerId
    adapter: AdapterName


class ReleasePrefixBlocks(Message, kw_only=True):
    """Free up to `blocks` cached-free prefix blocks of `instance_id` on `worker_id`, least recently used
    first (ctl `EvictPrefixBlocks`): KV no running request holds, kept only for a later prefix hit."""

    worker_id: WorkerId
    instance_id: InstanceId
    blocks: Count


class ScaleUp(Message, kw_only=True):
    """Start a new instance of `model` on `worker_id` (ideally one that has prewarmed it)."""

    model: ModelName
    worker_id: WorkerId
    instance_id: InstanceId


class ScaleDown(Message, kw_only=True):
    """Stop an instance (EvictModel, drain): its weights stay prewarmed through the grace period."""

    instance_id: InstanceId
    worker_id: WorkerId
    model: ModelName | None = None  # needed to apply it (EvictModel names the model)


PlanAction = (
    FormGroup | DissolveGroup | Migrate | DropInstanceLayers | RestoreInstanceLayers | ReportIdle | PlacePrewarm
    | ReleasePrewarm | ReleaseAdapter | ReleasePrefixBlocks | ScaleUp | ScaleDown
)

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
    refused: CtlRefusedCode | None = None  # a worker refused the command (its code); None: no answer, an error


class PlanCancelled(Message, kw_only=True):
    """A decided plan was dropped before it took effect: stale (the request finished or moved, a worker
    died), or its planner lost the lease. Nothing of it was applied."""

    plan_id: PlanId
    ts: Timestamp
    message: Reason


MemorySource = Literal["prefix", "prewarm", "adapter", "layers", "migrate", "scale_out", "queue"]
# how a bought offer's effect ended: applied; refused (a worker refused it, or it was cancelled stale: nothing
# done); failed (no answer, a deadline, an error)
PurchaseOutcome = Literal["applied", "refused", "failed"]


class SourcePrice(Value, kw_only=True):
    """One offer on a purchase's price list (shared/policy/memory_market.py): a source of memory, what it
    acts on, the bytes it frees and its price in request-seconds (expected delay added, summed over the
    requests it delays, within the horizon)."""

    source: MemorySource
    target: Annotated[str, Meta(max_length=512)]
    bytes: ByteCount
    price_request_s: Annotated[float, Meta(ge=0)]
    bought: bool = False
    plan_ids: Annotated[list[PlanId], Meta(max_length=1024)] = []  # the effects that carry it out (when bought)
    # how its effect ended (None: not bought, or not yet ended); filled in the planner's purchase log, never
    # on the PlanPurchased event (published before the effect is applied)
    outcome: PurchaseOutcome | None = None
    outcome_reason: Annotated[str, Meta(max_length=64)] = ""  # the refusal code, "stale", "expired", ...


class PlanPurchased(Message, kw_only=True):
    """The arbiter bought memory for one need (`[planner] economy = "arbiter"`): the price list it chose
    from, cheapest per byte first, and what it took. `reserve_request_s_per_byte` is waiting's price per
    byte: nothing dearer is bought; the part of the need not covered waits. Published before the
    bought effects' PlanDecided events; each effect then ends as usual (applied, failed or cancelled)."""

    purchase_id: PlanId
    ts: Timestamp
    scope: Annotated[str, Meta(min_length=1, max_length=256)]  # "worker:<id>" or "model:<name>"
    need_bytes: ByteCount
    horizon_s: Seconds
    waiting: Count
    reserve_request_s_per_byte: Annotated[float, Meta(ge=0)]
    prices: Annotated[list[SourcePrice], Meta(max_length=1024)] = []
    bought_bytes: ByteCount = 0
    price_request_s: Annotated[float, Meta(ge=0)] = 0.0  # what was bought, plus waiting for the rest
    reason: Reason = ""


PlanEvent = PlanDecided | PlanApplied | PlanFailed | PlanCancelled | PlanPurchased
PLAN_EVENT_KINDS: dict[str, type] = {
    "decided": PlanDecided, "applied": PlanApplied, "failed": PlanFailed, "cancelled": PlanCancelled,
    "purchased": PlanPurchased,
}
PlanOutcome = PlanApplied | PlanFailed | PlanCancelled  # how a plan ended


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


# --- tidal.v1.planner.purchases ---
class PurchaseLogRequest(Message, kw_only=True):
    """Ask the lease-holding planner for its latest purchases (`tidal status`, dashboards)."""

    limit: Annotated[int, Meta(ge=1, le=256)] = 10


class PurchaseOutcomeCount(Value, kw_only=True):
    """How many bought offers of one source ended one way, since the planner started."""

    source: MemorySource
    outcome: PurchaseOutcome
    reason: Annotated[str, Meta(max_length=64)] = ""
    count: Count = 0


class PurchaseLogReply(Message, kw_only=True):
    """The lease holder's latest purchases, newest first (empty under `economy = "fixed-order"`), and the
    outcomes of everything it bought since it started (`in_flight`: bought effects not ended yet)."""

    planner_id: ServiceId
    economy: Literal["fixed-order", "arbiter"]
    purchases: Annotated[list[PlanPurchased], Meta(max_length=256)] = []
    outcomes: Annotated[list[PurchaseOutcomeCount], Meta(max_length=1024)] = []
    in_flight: Count = 0


# --- tidal.v1.evt.planner.placement ---
RequestClassName = Literal["tiny", "T", "S", "M", "L"]


class PlacementEntry(Value, kw_only=True):
    """Requests of `model` whose prompt KV is in (lower_bytes, upper_bytes] (MELL class `request_class`)
    go to `worker_id`, if it has room; None: MELL would open a device it has no id for, or has no
    room: route by load. `room_bytes`: what MELL's plan leaves free on that worker (a larger request
    falls back too)."""

    request_class: RequestClassName
    lower_bytes: ByteCount  # exclusive
    upper_bytes: ByteCount  # inclusive
    worker_id: WorkerId | None = None
    room_bytes: ByteCount = 0


class PlacementHints(Message, kw_only=True):
    """The planner's placement for new requests of one model (MELL's Allocate, peeked), every interval:
    the dispatcher's `mell` routing sends a request where MELL would allocate it, so MELL need not
    migrate it there. Past `valid_until` the dispatcher ignores it (routes by load)."""

    model: ModelName
    ts: Timestamp
    capacity_bytes: ByteCount  # MELL's KV capacity C per device (the class bounds are fractions of it)
    entries: Annotated[list[PlacementEntry], Meta(max_length=16)] = []
    valid_until: Timestamp


__all__ = [
    "CapacityReply",
    "CapacityRequest",
    "DissolveGroup",
    "DropInstanceLayers",
    "FormGroup",
    "MemorySource",
    "Migrate",
    "PLAN_EVENT_KINDS",
    "PlacePrewarm",
    "PlacementEntry",
    "PlacementHints",
    "Plan",
    "PlanAction",
    "PlanPurchased",
    "PurchaseOutcome",
    "PurchaseOutcomeCount",
    "PurchaseLogReply",
    "PurchaseLogRequest",
    "SourcePrice",
    "PlanApplied",
    "PlanCancelled",
    "PlanDecided",
    "PlanEvent",
    "PlanFailed",
    "PlanOutcome",
    "PlanTrigger",
    "ReleaseAdapter",
    "ReleasePrefixBlocks",
    "ReleasePrewarm",
    "ReportIdle",
    "RequestClassName",
    "RestoreInstanceLayers",
    "ScaleDown",
    "ScaleUp",
]

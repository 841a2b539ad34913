"""Family `ctl`: control commands sent to one worker on `tidal.v1.worker.<worker_id>.ctl`.

The planner (and external schedulers) drive the memory economy with these: every command
names what to do to which model/adapter/layers/request, carries an idempotency key (a
retried command with the same key is applied once and answered `replayed=True`), and is
answered with `CtlDone` or `CtlRefused`. They are declared here as the public contract;
the mechanisms behind them arrive with later issues (engine residency, buddy groups, live
migration) and until then a worker answers `CtlRefused(code="unsupported")`.
"""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    AdapterName, ByteCount, GroupId, IdempotencyKey, InstanceId, Message, ModelName, PlanId, Reason, RequestId,
    WorkerId,
)
from shared.events.common import GroupMember, LayerRange
from shared.events.worker import PoolBreakdown

MigrationMode = Literal["kv", "tokens"]  # move the KV (pre-copy) or the tokens (re-prefill on the destination)


class CtlCommand(Message, kw_only=True):
    """Fields every control command carries (base class; not itself a wire message)."""

    idempotency_key: IdempotencyKey
    plan_id: PlanId | None = None  # the plan this command executes, for audit and dashboards


class LoadModel(CtlCommand, kw_only=True):
    """Create an instance of `model` holding `layers` (all when None), from disk or from a peer."""

    model: ModelName
    instance_id: InstanceId
    layers: LayerRange | None = None
    peer: WorkerId | None = None  # copy the weights from this worker over the data plane


class EvictModel(CtlCommand, kw_only=True):
    """Release an instance's weights (or, with no instance, `model`'s prewarmed layers)."""

    model: ModelName
    instance_id: InstanceId | None = None
    drain: bool = True  # finish its running requests first; False: they are re-dispatched


class LoadAdapter(CtlCommand, kw_only=True):
    """Make `adapter` resident on the device (it is served from host memory until then)."""

    adapter: AdapterName
    base: ModelName


class EvictAdapter(CtlCommand, kw_only=True):
    adapter: AdapterName


class DropLayers(CtlCommand, kw_only=True):
    """Release the weights of `layers` of an instance in a buddy group; the bytes become KV blocks."""

    instance_id: InstanceId
    group_id: GroupId
    layers: LayerRange


class RestoreLayers(CtlCommand, kw_only=True):
    """Load `layers` of an instance back (from the host copy, or from `peer`)."""

    instance_id: InstanceId
    layers: LayerRange
    peer: WorkerId | None = None


class Prewarm(CtlCommand, kw_only=True):
    """Load `layers` (the first ones) of another model into unused KV space, ahead of a scale-up."""

    model: ModelName
    layers: LayerRange
    max_bytes: ByteCount | None = None  # never take more of the pool than this
    peer: WorkerId | None = None


class JoinGroup(CtlCommand, kw_only=True):
    """Run `instance_id` as one stage of buddy group `group_id` (the members and their layers)."""

    group_id: GroupId
    instance_id: InstanceId
    members: Annotated[list[GroupMember], Meta(min_length=2, max_length=64)]


class LeaveGroup(CtlCommand, kw_only=True):
    group_id: GroupId
    instance_id: InstanceId


class MigrateOut(CtlCommand, kw_only=True):
    """Move running request `request_id` from this worker to `destination` (prepared by MigrateIn)."""

    request_id: RequestId
    destination: WorkerId
    destination_instance: InstanceId
    mode: MigrationMode = "kv"


class MigrateIn(CtlCommand, kw_only=True):
    """Prepare to receive `request_id` from `source` into `instance_id` (sent before MigrateOut)."""

    request_id: RequestId
    source: WorkerId
    instance_id: InstanceId
    mode: MigrationMode = "kv"


CtlRequest = (
    LoadModel
    | EvictModel
    | LoadAdapter
    | EvictAdapter
    | DropLayers
    | RestoreLayers
    | Prewarm
    | JoinGroup
    | LeaveGroup
    | MigrateOut
    | MigrateIn
)


class CtlDone(Message, kw_only=True):
    """The command was applied (or had been: `replayed`); `pool` is the pool right after it."""

    idempotency_key: IdempotencyKey
    command: Annotated[str, Meta(max_length=64)]  # the command's `type`
    worker_id: WorkerId
    replayed: bool = False
    pool: PoolBreakdown | None = None
    detail: Reason = ""


CtlRefusedCode = Literal[
    "unsupported",  # this worker does not implement the command (yet)
    "invalid",  # well-formed but inconsistent (e.g. layers beyond the model)
    "not_found",  # no such model, adapter, instance, group or request here
    "insufficient_memory",
    "busy",  # a conflicting command is in progress; retry later
    "conflict",  # the same idempotency key was used for a different command
]


class CtlRefused(Message, kw_only=True):
    idempotency_key: IdempotencyKey
    command: Annotated[str, Meta(max_length=64)]
    worker_id: WorkerId
    code: CtlRefusedCode
    message: Reason


CtlReply = CtlDone | CtlRefused

CTL_COMMANDS: tuple[type[CtlCommand], ...] = CtlRequest.__args__  # type: ignore[attr-defined]

__all__ = [
    "CTL_COMMANDS",
    "CtlCommand",
    "CtlDone",
    "CtlRefused",
    "CtlRefusedCode",
    "CtlReply",
    "CtlRequest",
    "DropLayers",
    "EvictAdapter",
    "EvictModel",
    "JoinGroup",
    "LeaveGroup",
    "LoadAdapter",
    "LoadModel",
    "MigrateIn",
    "MigrateOut",
    "MigrationMode",
    "Prewarm",
    "RestoreLayers",
]

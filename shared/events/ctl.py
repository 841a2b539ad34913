"""Family `ctl`: control commands sent to one worker on `tidal.v1.worker.<worker_id>.ctl`.

The planner (and external schedulers) drive the memory economy with these: every command
names what to do to which model/adapter/layers/request, carries an idempotency key (a
retried command with the same key is applied once and answered `replayed=True`), and is
answered with `CtlDone` or `CtlRefused`. They are declared here as the public contract;
the mechanisms behind them arrive with later issues (engine residency, buddy groups, live
migration) and until then a worker answers `CtlRefused(code="unsupported")`. Implemented
today: `LoadAdapter`/`EvictAdapter`/`OffloadAdapter` (services/gpu_worker/adapter_ctl.py) and
`MigrateIn`/`MigrateOut` (services/gpu_worker/migration.py), `JoinGroup`/`DropLayers`/`LeaveGroup`
(services/gpu_worker/group_ctl.py).
"""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    AdapterName, ByteCount, Count, FilePath, GroupId, IdempotencyKey, InstanceId, Message, ModelName, PlanId, Reason,
    RequestId, Seconds, Timestamp, Value, WorkerId,
)
from shared.events.common import GroupMember, LayerRange
from shared.events.worker import PoolBreakdown

MigrationMode = Literal["kv", "tokens"]  # move the KV (pre-copy) or the tokens (re-prefill on the destination)


class CtlCommand(Message, kw_only=True):
    """Fields every control command carries (base class; not itself a wire message)."""

    idempotency_key: IdempotencyKey
    plan_id: PlanId | None = None  # the plan this command executes, for audit and dashboards
    # Not executed once past (refused `expired`): a command held up by a partition was decided on a
    # view that is gone by the time it arrives. None: no deadline.
    deadline_ts: Timestamp | None = None


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
    """Register `adapter` (a PEFT directory) with the worker's instances of `base`, so requests may
    name it (the gateway's `POST /v1/load_lora_adapter`); it is made resident on the device on use."""

    adapter: AdapterName
    base: ModelName
    path: FilePath | None = None  # as the worker sees it; None: the path in the adapter's catalog record
    pinned: bool = False  # made resident on the device now and never evicted by LRU (docs/caraserve.md)


class EvictAdapter(CtlCommand, kw_only=True):
    """Unregister `adapter`: new requests naming it are refused at once; it is removed from the
    engine (and its device bytes freed) when the requests already running with it have finished."""

    adapter: AdapterName


class OffloadAdapter(CtlCommand, kw_only=True):
    """Free `adapter`'s device copy (its bytes go back to the pool); it stays registered and its host
    copy stays, so requests naming it are still taken: the next one loads it again (a cold start).
    What the memory economy buys when it evicts a cold adapter (the planner's `ReleaseAdapter`).

    Refused `busy` while a request admitted on this worker names it (running, or queued for the
    engine): a cold adapter only. Refused `not_found` when it is not registered here, `invalid`
    when it is pinned (pinned adapters never leave the device). Done with detail "not resident"
    when it has no device copy (idempotent); else the detail gives the device bytes freed."""

    adapter: AdapterName


class EvictPrefixBlocks(CtlCommand, kw_only=True):
    """Free up to `blocks` of `instance_id`'s cached-free prefix blocks, least recently used first (their
    bytes go back to the pool): what the memory economy buys when it gives up cached prefixes (the
    planner's `ReleasePrefixBlocks`). Blocks a running request holds are never freed. Refused `not_found`
    when no such instance is here, `unsupported` when its engine caches no prefixes; done with the number
    of blocks (and bytes) freed in the detail, 0 when none were cached."""

    instance_id: InstanceId
    blocks: Count


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
    # proactive prewarming (WarmServe §4.1): first cap this (grace-period) instance's KV at
    # `kv_cap_bytes` (Eq. 1's reservation target), its free blocks above it go back to the pool
    cap_instance_id: InstanceId | None = None
    kv_cap_bytes: ByteCount | None = None


class JoinGroup(CtlCommand, kw_only=True):
    """Run `instance_id` as one stage of buddy group `group_id` (the members and their layers)."""

    group_id: GroupId
    instance_id: InstanceId
    members: Annotated[list[GroupMember], Meta(min_length=2, max_length=64)]


class LeaveGroup(CtlCommand, kw_only=True):
    group_id: GroupId
    instance_id: InstanceId


class MigrateOut(CtlCommand, kw_only=True):
    """Move running request `request_id` from this worker to `destination`. Answered when the move
    is over: `CtlDone.migration` says how (KV, or tokens after a fallback) and the downtime;
    `CtlRefused` when the request stays here (it goes on, nothing lost)."""

    request_id: RequestId
    destination: WorkerId
    destination_instance: InstanceId
    mode: MigrationMode = "kv"


BlockIndex = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class MigrateIn(CtlCommand, kw_only=True):
    """Prepare to receive `request_id` from `source` into `instance_id`.

    From a planner on `worker.<id>.ctl` (optional, before MigrateOut): a readiness check. From
    the source of a KV migration on `worker.<id>.migrate`, with `reserve_tokens > 0`: allocate
    KV blocks for that many tokens (held under the request id; later stages grow them),
    released unless committed within `hold_s`."""

    request_id: RequestId
    source: WorkerId
    instance_id: InstanceId
    mode: MigrationMode = "kv"
    reserve_tokens: Count = 0
    expected_tokens: Count = 0  # prompt + max_tokens: lets the destination keep the chain contiguous
    kv_block_tokens: Annotated[int, Meta(ge=0, le=1024)] = 0  # the source's block size; must match (0: unchecked)
    adapter: AdapterName | None = None  # the request's adapter: refused at once if not registered here
    hold_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0


class MigrateKvStage(CtlCommand, kw_only=True):
    """Source → destination of a KV migration (on `worker.<id>.migrate`), one per pre-copy stage (and the final stop): grow
    the reservation to `reserve_tokens` and expect the data-plane transfer `key` into the
    request's blocks [first_block, last_block) (every layer, `transfer.kv_blocks` order).
    Answered CtlDone once the destination is ready; the source then sends."""

    request_id: RequestId
    source: WorkerId
    stage: Annotated[int, Meta(ge=0, le=1000)]
    key: Annotated[str, Meta(min_length=1, max_length=256)]
    first_block: BlockIndex
    last_block: BlockIndex
    reserve_tokens: Count
    final: bool = False  # the source has stopped the request: this is the last transfer


class MigrateKvCancel(CtlCommand, kw_only=True):
    """Source → destination: the KV migration is off; drop the expected transfers and free the
    reserved blocks (answered once nothing more can be written into them)."""

    request_id: RequestId
    source: WorkerId
    reason: Reason = ""


CtlRequest = (
    LoadModel
    | EvictModel
    | LoadAdapter
    | EvictAdapter
    | OffloadAdapter
    | EvictPrefixBlocks
    | DropLayers
    | RestoreLayers
    | Prewarm
    | JoinGroup
    | LeaveGroup
    | MigrateOut
    | MigrateIn
)

# Worker to worker on `tidal.v1.worker.<id>.migrate` (a KV migration's source to its destination)
MigrateRequest = MigrateIn | MigrateKvStage | MigrateKvCancel
MIGRATE_MESSAGES: tuple[type[CtlCommand], ...] = MigrateRequest.__args__  # type: ignore[attr-defined]


class MigrationReport(Value, kw_only=True):
    """How a MigrateOut went (on its CtlDone). Times are measured on the source's clock."""

    requested_mode: MigrationMode
    mode: MigrationMode  # how it moved: "tokens" after a KV fallback
    fallback: Reason = ""  # why KV mode fell back to tokens ("corrupt: ...")
    stages: Count = 0  # data-plane transfers, the final stop's included
    kv_bytes: ByteCount = 0  # KV bytes the destination acknowledged
    tokens: Count = 0  # prompt + output tokens of the request when it stopped
    kv_tokens: Count = 0  # of those, tokens whose KV moved (the rest is computed on the destination)
    downtime_s: Seconds = 0.0  # source stopped the request -> the destination's engine took it over
    total_s: Seconds = 0.0  # MigrateOut received -> done


class CtlDone(Message, kw_only=True):
    """The command was applied (or had been: `replayed`); `pool` is the pool right after it."""

    idempotency_key: IdempotencyKey
    command: Annotated[str, Meta(max_length=64)]  # the command's `type`
    worker_id: WorkerId
    replayed: bool = False
    pool: PoolBreakdown | None = None
    detail: Reason = ""
    migration: MigrationReport | None = None  # MigrateOut only


CtlRefusedCode = Literal[
    "unsupported",  # this worker does not implement the command (yet)
    "invalid",  # well-formed but inconsistent (e.g. layers beyond the model)
    "not_found",  # no such model, adapter, instance, group or request here
    "insufficient_memory",
    "busy",  # a conflicting command is in progress; retry later
    "conflict",  # the same idempotency key was used for a different command
    "expired",  # it arrived after its deadline_ts (held up by a partition): not executed
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
    "EvictPrefixBlocks",
    "JoinGroup",
    "LeaveGroup",
    "LoadAdapter",
    "LoadModel",
    "MigrateIn",
    "MigrateKvCancel",
    "MigrateKvStage",
    "MigrateOut",
    "MigrateRequest",
    "MIGRATE_MESSAGES",
    "MigrationReport",
    "MigrationMode",
    "OffloadAdapter",
    "Prewarm",
    "RestoreLayers",
]

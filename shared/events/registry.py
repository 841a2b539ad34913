"""Family `registry`: catalog records, the registry's request/reply API and change events.

The registry keeps one JetStream KV bucket per `Bucket`; a record's key is its name/id.
Every write is compare-and-set on the key's revision (`expected_revision`, 0 = create), so
two writers never silently overwrite each other: the loser gets `RegistryConflict`.

To watch the catalog: subscribe to `tidal.v1.evt.registry.<bucket>` first, then
`RegistryList`; apply a `CatalogChanged` only when its revision is above the one you hold.
"""
from __future__ import annotations

import enum
from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    MAX_LIST, AdapterName, ByteCount, Device, FilePath, GroupId, IdempotencyKey, InstanceId, Message,
    ModelName, PlanId, Revision, Seq, ServiceId, ServiceName, Timestamp, WorkerId,
)
from shared.events.common import GroupMember, LayerRange
from shared.events.worker import WorkerState


class Bucket(enum.StrEnum):
    MODELS = "models"
    ADAPTERS = "adapters"
    WORKERS = "workers"
    INSTANCES = "instances"
    GROUPS = "groups"
    SERVICES = "services"
    LEASES = "leases"


Dtype = Literal["float32", "bfloat16", "float16"]
LoraTarget = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]{1,32}$")]  # q_proj, k_proj, ..., down_proj
Host = Annotated[str, Meta(max_length=255)]


class ModelRecord(Message, kw_only=True):
    """A base model the cluster can serve (key: name)."""

    name: ModelName
    path: FilePath  # local Hugging Face directory, as seen by the workers
    arch: Annotated[str, Meta(max_length=64)] = ""  # e.g. LlamaForCausalLM
    dtype: Dtype = "float32"
    num_layers: Annotated[int, Meta(ge=1, le=4096)]
    max_context: Annotated[int, Meta(ge=1, le=2**24)]
    weight_bytes: ByteCount = 0  # all layers, embeddings and head, in `dtype`
    layer_bytes: ByteCount = 0  # one decoder layer (what dropping a layer frees)


class AdapterRecord(Message, kw_only=True):
    """A LoRA adapter of one base model (key: name)."""

    name: AdapterName
    base: ModelName
    path: FilePath  # PEFT directory
    rank: Annotated[int, Meta(ge=1, le=1024)]
    targets: Annotated[list[LoraTarget], Meta(min_length=1, max_length=16)]
    bytes: ByteCount = 0


WorkerLifecycle = Literal["idle", "universal", "dedicated", "grace"]


class WorkerRecord(Message, kw_only=True):
    """One device and its worker process (key: worker_id). `state` DEAD is set by the registry."""

    worker_id: WorkerId
    device: Device
    host: Host = ""
    memory_capacity_bytes: ByteCount
    state: WorkerState = WorkerState.STARTING
    incarnation: Annotated[str, Meta(max_length=64)] = ""
    ucx_address: Annotated[str, Meta(max_length=4096)] | None = None  # data-plane endpoint (issue 6)
    started_ts: Timestamp = 0.0
    last_heartbeat_ts: Timestamp = 0.0
    # WarmServe's worker lifecycle (§4, Fig. 5), written by the planner (compare-and-set): idle (no
    # weights), universal (prewarmed weights, no instance), dedicated (serving), grace (dedicated,
    # its instances stopping); None: not yet classified (no planner, or not yet seen)
    lifecycle: WorkerLifecycle | None = None


InstanceState = Literal["loading", "ready", "draining", "stopped"]


class InstanceRecord(Message, kw_only=True):
    """One replica of a model on one worker (key: instance_id)."""

    instance_id: InstanceId
    model: ModelName
    worker_id: WorkerId
    layers: LayerRange  # whose weights it holds (all, unless dropped into a buddy group)
    state: InstanceState = "loading"
    group_id: GroupId | None = None
    # LoRA adapters registered on it (from the config, or loaded at runtime): requests naming one may run here
    adapters: Annotated[list[AdapterName], Meta(max_length=MAX_LIST)] = []


GroupState = Literal["forming", "active", "restoring", "dissolved"]


class GroupRecord(Message, kw_only=True):
    """A buddy group: instances of one model that each dropped complementary layers (key: group_id)."""

    group_id: GroupId
    model: ModelName
    members: Annotated[list[GroupMember], Meta(min_length=2, max_length=64)]
    state: GroupState = "forming"
    plan_id: PlanId | None = None
    created_ts: Timestamp = 0.0


ServiceState = Literal["starting", "ready", "draining", "stopped", "dead"]


class ServiceRecord(Message, kw_only=True):
    """A running service process, announced at start (key: service_id)."""

    service_id: ServiceId
    service: ServiceName
    host: Host = ""
    pid: Annotated[int, Meta(ge=0, le=2**31 - 1)] = 0
    version: Annotated[str, Meta(max_length=64)] = ""
    state: ServiceState = "starting"
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    started_ts: Timestamp = 0.0
    last_heartbeat_ts: Timestamp = 0.0


class LeaseRecord(Message, kw_only=True):
    """Who holds a cluster-wide role (key: name, e.g. "planner"): one holder at a time, by compare-and-set.

    The holder rewrites it every `renew_every_s`; another contender takes it over once the record's
    revision has not changed for `ttl_s` on the contender's own clock (no clock sync needed)."""

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]
    holder: ServiceId
    term: Annotated[int, Meta(ge=1, le=2**53)] = 1  # +1 at every takeover
    ttl_s: Annotated[float, Meta(gt=0, le=3600)]
    renewed_ts: Timestamp = 0.0  # the holder's clock, for humans


Record = ModelRecord | AdapterRecord | WorkerRecord | InstanceRecord | GroupRecord | ServiceRecord | LeaseRecord

RECORD_BUCKET: dict[type, Bucket] = {
    ModelRecord: Bucket.MODELS,
    AdapterRecord: Bucket.ADAPTERS,
    WorkerRecord: Bucket.WORKERS,
    InstanceRecord: Bucket.INSTANCES,
    GroupRecord: Bucket.GROUPS,
    ServiceRecord: Bucket.SERVICES,
    LeaseRecord: Bucket.LEASES,
}
BUCKET_RECORD: dict[Bucket, type] = {bucket: cls for cls, bucket in RECORD_BUCKET.items()}


def record_key(record: Record) -> str:
    """The KV key of a record: its name or id."""
    match record:
        case ModelRecord() | AdapterRecord():
            return record.name
        case WorkerRecord():
            return record.worker_id
        case InstanceRecord():
            return record.instance_id
        case GroupRecord():
            return record.group_id
        case ServiceRecord():
            return record.service_id
        case LeaseRecord():
            return record.name
    raise TypeError(f"not a catalog record: {type(record).__name__}")


def record_bucket(record: Record) -> Bucket:
    return RECORD_BUCKET[type(record)]


Key = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
KeyPrefix = Annotated[str, Meta(pattern=r"^[A-Za-z0-9._-]{0,64}$")]


# --- requests on tidal.v1.registry.<op> ---
class RegistryGet(Message, kw_only=True):
    bucket: Bucket
    key: Key


class RegistryList(Message, kw_only=True):
    """Entries of a bucket in key order, `limit` at a time: pass the last key seen as `after`."""

    bucket: Bucket
    prefix: KeyPrefix = ""
    after: KeyPrefix = ""
    limit: Annotated[int, Meta(ge=1, le=MAX_LIST)] = 1000


class RegistryPut(Message, kw_only=True):
    """Create (`expected_revision=0`) or update (the revision you read) one record."""

    idempotency_key: IdempotencyKey
    record: Record
    expected_revision: Revision


class RegistryDelete(Message, kw_only=True):
    idempotency_key: IdempotencyKey
    bucket: Bucket
    key: Key
    expected_revision: Annotated[int, Meta(ge=1, le=2**63 - 1)]


# --- replies ---
class CatalogEntry(Message, kw_only=True):
    """A record as stored, with its revision (the value for the next compare-and-set)."""

    bucket: Bucket
    key: Key
    revision: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    record: Record
    updated_ts: Timestamp = 0.0


class RegistryNotFound(Message, kw_only=True):
    bucket: Bucket
    key: Key


class RegistryListing(Message, kw_only=True):
    bucket: Bucket
    entries: Annotated[list[CatalogEntry], Meta(max_length=MAX_LIST)] = []
    more: bool = False  # another page follows: list again with after = entries[-1].key


class RegistryWritten(Message, kw_only=True):
    bucket: Bucket
    key: Key
    revision: Annotated[int, Meta(ge=1, le=2**63 - 1)]  # the new revision
    replayed: bool = False  # same idempotency key as an earlier, applied write


class RegistryConflict(Message, kw_only=True):
    """Compare-and-set lost: the key is at `actual_revision` (0 = absent), not `expected_revision`."""

    bucket: Bucket
    key: Key
    expected_revision: Revision
    actual_revision: Revision


class RegistryDeleted(Message, kw_only=True):
    bucket: Bucket
    key: Key
    revision: Annotated[int, Meta(ge=1, le=2**63 - 1)]  # the revision of the delete marker


GetReply = CatalogEntry | RegistryNotFound
PutReply = RegistryWritten | RegistryConflict
DeleteReply = RegistryDeleted | RegistryConflict | RegistryNotFound


# --- events ---
class CatalogChanged(Message, kw_only=True):
    """Published on `tidal.v1.evt.registry.<bucket>` after every applied write (and liveness change)."""

    bucket: Bucket
    key: Key
    revision: Annotated[int, Meta(ge=1, le=2**63 - 1)]
    op: Literal["put", "delete"]
    record: Record | None = None  # the new record on put; None on delete
    ts: Timestamp


class ServiceHeartbeat(Message, kw_only=True):
    """Liveness of a non-worker service process (workers send WorkerHeartbeat)."""

    service_id: ServiceId
    service: ServiceName
    seq: Seq
    ts: Timestamp
    state: ServiceState = "ready"


__all__ = [
    "BUCKET_RECORD",
    "Bucket",
    "CatalogChanged",
    "CatalogEntry",
    "AdapterRecord",
    "DeleteReply",
    "Dtype",
    "GetReply",
    "GroupRecord",
    "InstanceRecord",
    "LeaseRecord",
    "ModelRecord",
    "PutReply",
    "RECORD_BUCKET",
    "Record",
    "RegistryConflict",
    "RegistryDelete",
    "RegistryDeleted",
    "RegistryGet",
    "RegistryList",
    "RegistryListing",
    "RegistryNotFound",
    "RegistryPut",
    "RegistryWritten",
    "ServiceHeartbeat",
    "ServiceRecord",
    "WorkerLifecycle",
    "WorkerRecord",
    "record_bucket",
    "record_key",
]

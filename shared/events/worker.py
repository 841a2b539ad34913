"""Family `worker`: assignments to a worker, its stats and its heartbeats.

Subjects: `tidal.v1.worker.<worker_id>.assign` (request/reply), `tidal.v1.evt.worker.stats`
and `tidal.v1.evt.worker.heartbeat` (pub/sub). Control commands (`...<worker_id>.ctl`) are
in `shared.events.ctl`.
"""
from __future__ import annotations

import enum
from typing import Annotated, Literal

from msgspec import Meta, field

from shared.events.base import (
    MAX_LIST, AdapterName, Attempt, ByteCount, Count, Device, GroupId, Handover, IdempotencyKey, InstanceId, Message,
    ModelName, Rate, Reason, RequestId, Seconds, Seq, Timestamp, TokenId, Value, WorkerId,
)
from shared.events.common import LayerRange, SamplingParams
from shared.events.dispatch import Priority, PromptTokens


class WorkerState(enum.StrEnum):
    STARTING = "starting"  # loading its models; takes no assignments yet
    READY = "ready"
    DRAINING = "draining"  # finishing admitted requests; takes no new ones
    DEAD = "dead"  # set by the registry when heartbeats stop (never by the worker)


class Assignment(Message, kw_only=True):
    """The dispatcher hands one request to one instance on this worker.

    On a re-dispatch (the first worker died) `resume_token_ids` holds the tokens the client
    already received: the worker re-prefills prompt + those tokens, does not emit them again,
    and numbers its first chunk `next_seq`, so the client's stream has no gap and no duplicate.
    """

    idempotency_key: IdempotencyKey  # e.g. "<request_id>:<attempt>"
    request_id: RequestId
    instance_id: InstanceId
    model: ModelName
    adapter: AdapterName | None = None
    prompt_token_ids: PromptTokens
    sampling: SamplingParams = SamplingParams()
    priority: Priority = 0
    arrival_ts: Timestamp
    deadline_ts: Timestamp | None = None
    attempt: Attempt = 0  # 0 on the first dispatch, +1 per re-dispatch
    handover: Handover = 0  # +1 per live migration within the attempt (its chunks carry both: the fence)
    resume_token_ids: Annotated[list[TokenId], Meta(max_length=262_144)] = []
    next_seq: Seq = 0
    # KV migration's commit (worker to worker, never from a dispatcher): the KV of the first N
    # tokens of prompt + resume_token_ids is already in blocks reserved here under request_id
    # (MigrateIn/MigrateKvStage); the engine continues on top of them instead of re-prefilling.
    kv_computed_tokens: Count = 0


class AssignAccepted(Message, kw_only=True):
    request_id: RequestId
    worker_id: WorkerId
    instance_id: InstanceId
    replayed: bool = False  # the same idempotency key was already accepted; nothing was done twice


AssignRejectReason = Literal[
    "no_capacity",  # the instance's waiting queue or KV is full
    "model_not_loaded",  # this worker holds no such instance
    "adapter_unavailable",  # the adapter is unknown to this worker or cannot be loaded
    "draining",
    "kv_unavailable",  # a KV migration's commit found no (complete) reservation for the request
]


class AssignRejected(Message, kw_only=True):
    request_id: RequestId
    worker_id: WorkerId
    reason: AssignRejectReason
    message: Reason
    retry_after_s: Seconds | None = None


AssignReply = AssignAccepted | AssignRejected


class MemoryKind(enum.StrEnum):
    """What a byte of the device pool is used for (DESIGN §1, the memory economy)."""

    WEIGHTS = "weights"  # layers of models this worker serves
    PREWARM = "prewarm"  # layers of other models, loaded ahead of a scale-up
    ADAPTER = "adapter"  # LoRA adapters resident on the device
    KV = "kv"  # KV cache blocks
    WORKSPACE = "workspace"  # activations, sampler and kernel scratch


class MemoryHolding(Value, kw_only=True):
    """One attributable use of the pool: which kind, for whom, which layers, how many bytes."""

    kind: MemoryKind
    owner: Annotated[str, Meta(max_length=128)] = ""  # model, adapter or instance id; "" for shared
    layers: LayerRange | None = None
    bytes: ByteCount


class PoolBreakdown(Value, kw_only=True):
    """The device pool by kind (one pool per worker, shared by its instances); the kinds and
    free sum to capacity. Each instance's share is in its InstanceStats."""

    capacity_bytes: ByteCount
    weights_bytes: ByteCount = 0
    prewarm_bytes: ByteCount = 0
    adapter_bytes: ByteCount = 0
    kv_bytes: ByteCount = 0  # reserved for KV blocks (used or not; see InstanceStats for use)
    workspace_bytes: ByteCount = 0
    free_bytes: ByteCount = 0
    holdings: Annotated[list[MemoryHolding], Meta(max_length=MAX_LIST)] = []


class RequestLoad(Value, kw_only=True):
    """One request on an instance (running or waiting) and its KV: what a planner packs (MELL)."""

    request_id: RequestId
    prompt_tokens: Count = 0
    tokens: Count = 0  # prompt + generated so far
    kv_tokens: Count = 0  # of those, tokens whose KV is computed here
    kv_bytes: ByteCount = 0  # the KV blocks it holds now (every layer)
    projected_kv_bytes: ByteCount = 0  # what it will hold at prompt + max_tokens (or the context length)


LoraRank = Annotated[int, Meta(ge=0, le=1024)]
MAX_REQUEST_LOADS = 1024  # per instance per stats message; the rest are left out (largest KV first kept)
ColdChoice = Literal["cpu_assist", "async", "inline"]
MAX_COLD_DECISIONS = 32  # per instance per stats message: the latest cold-start decisions


class LoRAColdDecision(Value, kw_only=True):
    """One cold LoRA request's decision by the engine's cold-start rule (issue 31, docs/caraserve.md):
    CPU assist, the asynchronous load or an inline load, and why (e.g. "T_cpu 12.0 ms < X 16.8 ms + P 32.0 ms")."""

    request_id: RequestId
    choice: ColdChoice
    reason: Annotated[str, Meta(max_length=240)] = ""


class LoRAColdStarts(Value, kw_only=True):
    """An instance's cold LoRA requests by the choice its rule made (each counted once, at its first
    decision; cumulative since its engine started), the prefills the device took over inside a step,
    and the latest decisions (oldest first, at most MAX_COLD_DECISIONS)."""

    cpu_assist: Count = 0
    async_load: Count = field(default=0, name="async")
    inline: Count = 0
    mid_step_takeovers: Count = 0
    recent: Annotated[list[LoRAColdDecision], Meta(max_length=MAX_COLD_DECISIONS)] = []


class InstanceStats(Value, kw_only=True):
    """Load of one model instance on this worker."""

    instance_id: InstanceId
    model: ModelName
    layers: LayerRange  # the layers whose weights this worker holds; a buddy-group member: its stage
    group_id: GroupId | None = None
    running: Count = 0  # sequences in the batch
    waiting: Count = 0  # admitted, not yet scheduled
    queued_prompt_tokens: Count = 0  # prompt tokens not yet prefilled
    kv_blocks_total: Count = 0  # the most it could hold: its own + what the worker's shared pool could give it
    kv_blocks_used: Count = 0
    kv_block_bytes: ByteCount = 0
    # Its share of the worker's one pool now (the instances' shares plus PoolBreakdown.free_bytes
    # make the capacity): KV blocks it holds, live and free (free ones go to other instances on
    # demand), and the bytes it charged of the other kinds.
    kv_used_bytes: ByteCount = 0
    kv_free_bytes: ByteCount = 0
    weights_bytes: ByteCount = 0
    adapter_bytes: ByteCount = 0
    workspace_bytes: ByteCount = 0
    kv_growth_blocks_per_s: Annotated[float, Meta(ge=-1e9, le=1e9)] = 0.0
    tokens_per_s: Rate = 0.0  # generated, over the last stats interval
    # prompt tokens per second of prefill, over the prefill steps since the last stats (carried while none
    # ran; 0: never measured): how fast a re-prefilled request would be computed here (MELL's token mode)
    prefill_tokens_per_s: Rate = 0.0
    preemptions: Count = 0  # recompute preemptions since the instance started (cumulative)
    adapters: Annotated[list[AdapterName], Meta(max_length=MAX_LIST)] = []  # registered here: routable
    requests: Annotated[list[RequestLoad], Meta(max_length=MAX_REQUEST_LOADS)] = []
    # CaraServe's rank-aware routing: the LoRA rank of each request in the batch and queue (0: none),
    # and the device bytes a newly loaded adapter could get (free pool + unpinned adapters to evict)
    running_ranks: Annotated[list[LoraRank], Meta(max_length=MAX_REQUEST_LOADS)] = []
    waiting_ranks: Annotated[list[LoraRank], Meta(max_length=MAX_REQUEST_LOADS)] = []
    adapter_room_bytes: ByteCount | None = None
    accepting: bool = True  # False: being evicted (EvictModel): it finishes its requests and takes no new ones
    # Prefix caching (the engine's PrefixCache; all 0 when it caches none): its cached-free blocks (KV no
    # running request holds, kept for a later hit: the memory economy's `prefix` source, ctl
    # EvictPrefixBlocks) and their bytes; the block hit rate (hit / looked-up full blocks) over the stats
    # publisher's recent window, and the cumulative counts it comes from
    prefix_cached_free_blocks: Count = 0
    prefix_cached_free_bytes: ByteCount = 0
    prefix_hit_rate: Annotated[float, Meta(ge=0, le=1)] = 0.0
    prefix_queried_blocks: Count = 0
    prefix_hit_blocks: Count = 0
    # CaraServe's cold start (issue 31): what the engine's rule chose per cold LoRA request (None: it never had one)
    lora_cold: LoRAColdStarts | None = None


AdapterLevel = Literal["device", "host"]


class AdapterResidency(Value, kw_only=True):
    """Where one adapter is warm on this worker: a row per level it is at (device copies have a
    host copy too, unless spilled). Registered adapters with no row are cold (re-read from disk)."""

    adapter: AdapterName
    level: AdapterLevel
    pinned: bool = False  # device level: never evicted by LRU (`pinned: true` on load)
    rank: LoraRank = 0
    bytes: ByteCount = 0
    # requests admitted on this worker (running, queued in an engine or waiting to be) that name it; an
    # adapter with users is not offered for offload (the worker would refuse it `busy`). 0 from old workers
    users: Count = 0


class WorkerStats(Message, kw_only=True):
    """Published by each worker every stats interval (250 ms by default)."""

    worker_id: WorkerId
    seq: Seq
    ts: Timestamp
    device: Device
    state: WorkerState
    pool: PoolBreakdown
    instances: Annotated[list[InstanceStats], Meta(max_length=MAX_LIST)] = []
    resident_adapters: Annotated[list[AdapterName], Meta(max_length=MAX_LIST)] = []
    adapter_residency: Annotated[list[AdapterResidency], Meta(max_length=MAX_LIST)] = []


class WorkerHeartbeat(Message, kw_only=True):
    """Liveness. The registry marks a worker dead `registry.dead_after` after its last heartbeat.

    `incarnation` changes every time the worker process starts, so a restarted worker with
    the same id is told apart from the old one (whose in-flight requests were lost, and which
    held no buddy group). `service_id` is the process's ServiceRecord key, which the heartbeat
    keeps alive too ("": the incarnation is the service id, as older workers sent).
    """

    worker_id: WorkerId
    incarnation: Annotated[str, Meta(min_length=1, max_length=64)]
    service_id: Annotated[str, Meta(max_length=64)] = ""
    seq: Seq
    ts: Timestamp
    state: WorkerState


MAX_PREFIX_HASHES = 4096  # block hashes per PrefixSummary: the most recently used first, the rest left out
BlockHash = Annotated[int, Meta(ge=0, description="A full KV block's chained 64-bit hash (shared/prefix_hash.py): an unsigned 64-bit integer.")]


class PrefixSummary(Message, kw_only=True):
    """The prefixes one instance holds in its KV (automatic prefix caching), for prefix-aware routing.

    `hashes` name full blocks by the hash chained over their tokens, the previous block's hash and
    the model/adapter salt (`shared.prefix_hash`): a request whose first k block hashes are all
    here reuses k blocks of KV. Most recently used first, at most MAX_PREFIX_HASHES (`held_blocks`
    says how many the instance holds in all). Sent when the set or the hit counters change, at most
    every `min_interval`, and unchanged at least every `max_silence` (docs/serving.md), so `seq`
    and `ts` tell a reader how fresh it is: drop one older than a few `max_silence`."""

    worker_id: WorkerId
    instance_id: InstanceId
    model: ModelName
    seq: Seq  # +1 per summary of this instance (restarts at 0 with the worker process)
    ts: Timestamp
    block_size: Annotated[int, Meta(ge=1, le=1024)]  # tokens per block
    hashes: Annotated[list[BlockHash], Meta(max_length=MAX_PREFIX_HASHES)] = []
    held_blocks: Count = 0  # blocks with a hash the instance holds (in use or cached-free)
    cached_free_blocks: Count = 0  # of those, held by no running request: evictable
    queried_blocks: Annotated[int, Meta(ge=0, le=2**53)] = 0  # cumulative: full prompt blocks looked up
    hit_blocks: Annotated[int, Meta(ge=0, le=2**53)] = 0  # cumulative: ... and found cached


__all__ = [
    "AdapterLevel",
    "AdapterResidency",
    "AssignAccepted",
    "AssignRejectReason",
    "AssignRejected",
    "AssignReply",
    "Assignment",
    "InstanceStats",
    "LoRAColdDecision",
    "LoRAColdStarts",
    "MemoryHolding",
    "MemoryKind",
    "PoolBreakdown",
    "PrefixSummary",
    "RequestLoad",
    "WorkerHeartbeat",
    "WorkerState",
    "WorkerStats",
]

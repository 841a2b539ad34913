"""The routing-policy interface: which instance gets a request.

Pure: no I/O, no clock reads; `now` is an argument. The live dispatcher and the
simulator (`loadgen.sim`) both build `RequestView` / `InstanceView` values and call
`RoutingPolicy.choose`. Later policies (KunServe's overflow rebalancing, MELL's bin
packing, CaraServe's rank-aware cost model, WarmServe's prewarm-aware placement) implement
the same Protocol, so anything they need about an instance belongs in `InstanceView`.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec



class RequestView(msgspec.Struct, frozen=True, kw_only=True):
    """What a routing policy may know about one request."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    adapter: str | None = None
    adapter_rank: int = 0  # the adapter's LoRA rank (0: none or unknown), for rank-aware costs
    adapter_bytes: int = 0  # its device bytes (0: unknown), to tell whether an instance has room to load it


class InstanceView(msgspec.Struct, frozen=True, kw_only=True):
    """One model instance as the router sees it (a snapshot; may be a stats interval old)."""

    instance_id: str
    worker_id: str
    model: str
    live: bool = True  # ready and taking assignments (not starting, draining or dead)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    block_size: int = 16  # tokens per KV block
    queued_prompt_tokens: int = 0  # prompt tokens assigned here but not yet prefilled
    running_requests: int = 0  # sequences in the batch
    waiting_requests: int = 0  # assigned, not yet in the batch
    resident_adapters: frozenset[str] = frozenset()
    adapters: frozenset[str] | None = None  # LoRA adapters registered on it; None: unknown (any may be tried)
    max_batch: int = 64
    running_ranks: tuple[int, ...] = ()  # LoRA rank of each request in the batch (0: no adapter)
    waiting_ranks: tuple[int, ...] = ()  # ... and of each waiting one
    adapter_room_bytes: int | None = None  # device bytes it could give a newly loaded adapter; None: unknown
    kv_block_bytes: int = 0  # bytes of one KV block (all layers), for KV-size routing (mell); 0: unknown
    group_id: str | None = None  # the KunServe buddy group it is a stage of (routing_groups.py pools a group)
    layers: tuple[int, int] | None = None  # [start, end) of the layers it keeps; None: unknown (all)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token holds on this instance (0.0: unknown)."""
        return self.kv_block_bytes / self.block_size if self.block_size else 0.0

    @property
    def kv_tokens_used(self) -> int:
        return self.kv_blocks_used * self.block_size

    @property
    def kv_tokens_total(self) -> int:
        return self.kv_blocks_total * self.block_size

    @property
    def outstanding_tokens(self) -> int:
        """Work the instance holds: tokens in KV plus prompt tokens still to prefill."""
        return self.kv_blocks_used * self.block_size + self.queued_prompt_tokens


# Which instances the admission gate offers a policy for an adapter request (`adapter_gate`, a
# class attribute; without one, "resident_first"): "resident_first" narrows to instances where the
# adapter is resident when any is; "hostable" offers every instance that can host it (resident, or
# room to load it: CaraServe Alg. 1's candidates) and leaves the cold load to the policy's cost.
AdapterGate = Literal["resident_first", "hostable"]


def can_host(request: RequestView, inst: InstanceView) -> bool:
    """The request's adapter is resident there, or the instance has room to load it (unknown room: yes)."""
    adapter = request.adapter
    if adapter is None or adapter in inst.resident_adapters or inst.adapter_room_bytes is None:
        return True
    return inst.adapter_room_bytes >= max(request.adapter_bytes, 1)  # unknown size: any room at all


@runtime_checkable
class RoutingPolicy(Protocol):
    """Choose an instance for a request, or None when no instance has capacity for it."""

    name: str

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None: ...


def candidates(request: RequestView, instances: Sequence[InstanceView]) -> list[InstanceView]:
    """Live instances of the request's model (with its adapter registered, if it names one) whose
    whole KV could ever hold its prompt."""
    need, adapter = request.prompt_tokens, request.adapter
    return [
        inst for inst in instances
        if inst.live and inst.model == request.model and inst.kv_blocks_total * inst.block_size >= need
        and (adapter is None or inst.adapters is None or adapter in inst.adapters)
    ]


class LeastOutstandingWork:
    """Least outstanding work (KV in use + queued prompt tokens); ties go to fewer running
    requests, then to the smaller instance id, so the choice never depends on list order."""

    name = "least-load"

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        best: InstanceView | None = None
        best_key: tuple[int, int, str] | None = None
        model, need = request.model, request.prompt_tokens
        for inst in instances:
            bs = inst.block_size
            if not inst.live or inst.model != model or inst.kv_blocks_total * bs < need:
                continue
            key = (inst.kv_blocks_used * bs + inst.queued_prompt_tokens, inst.running_requests, inst.instance_id)
            if best_key is None or key < best_key:
                best, best_key = inst, key
        return None if best is None else best.instance_id


class HashRandom:
    """A uniformly random candidate, drawn from a hash of (seed, request id): stateless and
    reproducible, so a simulation with the same seed makes the same choices."""

    name = "random"
    adapter_gate: AdapterGate = "hostable"  # CaraServe §7.5's Random: any server that can host the adapter

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def choose(self, request: RequestView, instances: Sequence[InstanceView], now: float) -> str | None:
        pool = sorted((i for i in candidates(request, instances) if can_host(request, i)), key=lambda i: i.instance_id)
        if not pool:
            return None
        digest = hashlib.blake2b(f"{self.seed}:{request.request_id}".encode(), digest_size=8).digest()
        return pool[int.from_bytes(digest, "big") % len(pool)].instance_id

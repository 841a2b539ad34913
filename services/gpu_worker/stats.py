"""`WorkerStats` from the instances' snapshots: the pool by kind and owner, load, KV growth.

No I/O and no clock reads: the publisher calls `StatsBuilder.build(state, now)` every
stats interval; rates (KV growth in blocks/s, tokens/s) are the change between the two
latest distinct snapshots of an instance, divided by the time between them.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from services.gpu_worker.cold_metrics import cold_starts
from services.gpu_worker.instance import ModelInstance
from services.gpu_worker.instance_snapshot import InstanceSnapshot
from services.gpu_worker.prefix_stats import PrefixRates
from shared.events import InstanceStats, LayerRange, MemoryHolding, MemoryKind, PoolBreakdown, WorkerState, WorkerStats
from shared.events.base import MAX_LIST
from shared.events.worker import MAX_REQUEST_LOADS, AdapterResidency, RequestLoad

# The engine's pool kinds → the wire's (the engine says "lora", the catalog "adapter").
_KINDS = {"weights": MemoryKind.WEIGHTS, "prewarm": MemoryKind.PREWARM, "lora": MemoryKind.ADAPTER,
          "kv": MemoryKind.KV, "workspace": MemoryKind.WORKSPACE}
_FIELD = {MemoryKind.WEIGHTS: "weights_bytes", MemoryKind.PREWARM: "prewarm_bytes", MemoryKind.ADAPTER: "adapter_bytes",
          MemoryKind.KV: "kv_bytes", MemoryKind.WORKSPACE: "workspace_bytes"}
_LAYER = re.compile(r":layer(\d+)$")


def pool_breakdown(pairs: list[tuple[str, InstanceSnapshot]]) -> PoolBreakdown:
    """The instances' charges summed (a pool the instances share counted once); one holding per
    (instance, kind, owner), layers where known."""
    totals = {name: 0 for name in _FIELD.values()}
    holdings: list[MemoryHolding] = []
    capacity = 0
    shared: dict[int, int] = {}  # pool id -> capacity
    for instance_id, snap in pairs:
        if snap.pool_id is None:
            capacity += snap.pool_capacity
        else:
            shared[snap.pool_id] = snap.pool_capacity
        for kind_name, owners in snap.pool_by_owner.items():
            kind = _KINDS.get(kind_name)
            if kind is None:
                continue
            for owner, nbytes in owners.items():
                totals[_FIELD[kind]] += nbytes
                layer = _LAYER.search(owner)
                holdings.append(MemoryHolding(
                    kind=kind, owner=f"{instance_id}/{owner}"[:128], bytes=nbytes,
                    layers=LayerRange(start=int(layer.group(1)), end=int(layer.group(1)) + 1) if layer else None,
                ))
    capacity += sum(shared.values())
    used = sum(totals.values())
    return PoolBreakdown(capacity_bytes=capacity, free_bytes=max(0, capacity - used), holdings=holdings, **totals)


def instance_bytes(snap: InstanceSnapshot, block_bytes: int) -> dict[str, int]:
    """One instance's share of the pool: its KV blocks (live, free) and its other kinds' bytes."""
    def kind(name: str) -> int:
        return sum(snap.pool_by_owner.get(name, {}).values())

    return {
        "kv_used_bytes": snap.kv_blocks_used * block_bytes,
        "kv_free_bytes": max(0, snap.kv_blocks_held - snap.kv_blocks_used) * block_bytes,
        "weights_bytes": kind("weights"), "adapter_bytes": kind("lora"), "workspace_bytes": kind("workspace"),
    }


def request_loads(snap: InstanceSnapshot, block_bytes: int) -> list[RequestLoad]:
    """The snapshot's per-request rows, typed; bounded (the largest KV kept when there are too many)."""
    rows = snap.requests
    if len(rows) > MAX_REQUEST_LOADS:
        rows = tuple(sorted(rows, key=lambda r: -r[4])[:MAX_REQUEST_LOADS])
    return [RequestLoad(request_id=rid, prompt_tokens=prompt, tokens=tokens, kv_tokens=computed,
                        kv_bytes=held * block_bytes, projected_kv_bytes=final * block_bytes)
            for rid, prompt, tokens, computed, held, final in rows]


def adapter_residency(snaps: list[InstanceSnapshot],
                      users: Mapping[str, int] | None = None) -> list[AdapterResidency]:
    """One row per (adapter, level) on this worker: bytes summed over its instances, pinned if any pins it;
    `users`: requests admitted here per adapter name (on the device rows)."""
    rows: dict[tuple[str, str], AdapterResidency] = {}
    for snap in snaps:
        for name, level, pinned, rank, nbytes in snap.adapter_residency:
            seen = rows.get((name, level))
            if seen is not None:
                pinned, nbytes = pinned or seen.pinned, nbytes + seen.bytes
            rows[(name, level)] = AdapterResidency(adapter=name, level=level, pinned=pinned, rank=rank, bytes=nbytes,  # type: ignore[arg-type]
                                                   users=(users or {}).get(name, 0) if level == "device" else 0)
    return [rows[key] for key in sorted(rows)][:MAX_LIST]


def _layers(inst: ModelInstance, snap: InstanceSnapshot) -> LayerRange:
    """A buddy-group member's stage (the layers it runs for the group, whose weights it keeps: the
    members' stages tile the model, which is how a dispatcher sees a runnable group); else the layers
    whose weights the instance holds (all, unless a restore is under way)."""
    member = getattr(inst, "group", None)  # set on the engine thread by JoinGroup, read here as it stands
    if member is not None and member.group_id is not None and not member.solo:
        return LayerRange(start=member.layers.start, end=member.layers.stop)
    held = snap.resident_layers or (0, inst.num_layers)
    return LayerRange(start=held[0], end=held[1])


def _group(inst: ModelInstance) -> str | None:
    member = getattr(inst, "group", None)  # set on the engine thread by JoinGroup, read here as it stands
    return member.group_id if member is not None else None


class StatsBuilder:
    def __init__(self, worker_id: str, device: str, instances: list[ModelInstance],
                 pool_extra: Callable[[], list[tuple[str, InstanceSnapshot]]] | None = None,
                 adapter_users: Callable[[], Mapping[str, int]] | None = None) -> None:
        self.worker_id = worker_id
        self.device = device
        self.instances = instances  # replaced as instances come and go (LoadModel / EvictModel)
        self.pool_extra = pool_extra  # pool holdings no instance owns (prewarmed weights), as snapshots
        self.adapter_users = adapter_users  # requests admitted here per adapter (the worker's active table)
        self.seq = 0
        self._previous: dict[str, InstanceSnapshot] = {}
        self._rate: dict[str, float] = {}  # instance -> its last measured token rate (carried over a long step)
        self._prefill_rate: dict[str, float] = {}  # instance -> its last measured prefill pace (carried while idle)
        self.prefix = PrefixRates()  # the prefix cache's figures and recent hit rate (prefix_stats.py)

    def build(self, state: WorkerState, now: float) -> WorkerStats:
        instances = list(self.instances)
        pairs = [(inst.instance_id, inst.snapshot) for inst in instances]
        stats: list[InstanceStats] = []
        adapters: set[str] = set()
        for inst, (_, snap) in zip(instances, pairs):
            prev = self._previous.get(inst.instance_id)
            growth = tokens_per_s = 0.0
            if prev is not None and snap.ts > prev.ts:
                dt = snap.ts - prev.ts
                growth = (snap.kv_blocks_used - prev.kv_blocks_used) / dt
                # a rate only over busy time: from an idle snapshot the interval holds the idle gap too (a first
                # token after 54 s idle read 0.02 tok/s, and the planner took it for a 54 s decode step)
                tokens_per_s = max(0, snap.tokens_emitted - prev.tokens_emitted) / dt if prev.running else 0.0
                self._rate[inst.instance_id] = tokens_per_s
            elif snap.running:
                # no step ended since the last stats (a step longer than the interval, on a loaded box): the
                # instance is still decoding at its last measured rate, not at 0 -- the planner's compute
                # gate and the saturation rule read this figure
                tokens_per_s = self._rate.get(inst.instance_id, 0.0)
            if prev is not None and snap.prefill_s > prev.prefill_s:
                self._prefill_rate[inst.instance_id] = (snap.prefill_tokens - prev.prefill_tokens) / (
                    snap.prefill_s - prev.prefill_s)
            if prev is None or snap.ts > prev.ts:
                self._previous[inst.instance_id] = snap
            adapters.update(snap.resident_adapters)
            stats.append(InstanceStats(
                instance_id=inst.instance_id, model=inst.model, layers=_layers(inst, snap),
                group_id=_group(inst),
                running=snap.running, waiting=snap.waiting + inst.pending, queued_prompt_tokens=snap.queued_prompt_tokens,
                kv_blocks_total=snap.kv_blocks_total, kv_blocks_used=snap.kv_blocks_used, kv_block_bytes=inst.block_bytes,
                kv_growth_blocks_per_s=max(-1e9, min(1e9, growth)), tokens_per_s=tokens_per_s,
                prefill_tokens_per_s=min(1e12, self._prefill_rate.get(inst.instance_id, 0.0)),
                preemptions=snap.preemptions,
                adapters=sorted(inst.adapters),  # registered: what the dispatcher may route here
                accepting=getattr(inst, "accepting", True),  # False: being evicted (EvictModel), routed nowhere
                requests=request_loads(snap, inst.block_bytes), **instance_bytes(snap, inst.block_bytes),
                running_ranks=list(snap.running_ranks[:MAX_REQUEST_LOADS]),
                waiting_ranks=list(snap.waiting_ranks[:MAX_REQUEST_LOADS]), adapter_room_bytes=snap.adapter_room_bytes,
                **self.prefix.fields(inst, now), lora_cold=cold_starts(getattr(inst, "engine", None)),
            ))
        self.prefix.forget({inst.instance_id for inst in instances})
        for rates in (self._rate, self._prefill_rate):
            for gone in set(rates) - {inst.instance_id for inst in instances}:
                del rates[gone]
        msg = WorkerStats(
            worker_id=self.worker_id, seq=self.seq, ts=now,
            device=self.device, state=state, pool=pool_breakdown(pairs + (self.pool_extra() if self.pool_extra else [])),
            instances=stats,
            resident_adapters=sorted(adapters), adapter_residency=adapter_residency(
                [s for _, s in pairs], self.adapter_users() if self.adapter_users else None),
        )
        self.seq += 1
        return msg

"""`WorkerStats` from the instances' snapshots: the pool by kind and owner, load, KV growth.

No I/O and no clock reads: the publisher calls `StatsBuilder.build(state, now)` every
stats interval; rates (KV growth in blocks/s, tokens/s) are the change between the two
latest distinct snapshots of an instance, divided by the time between them.
"""
from __future__ import annotations

import re

from services.gpu_worker.instance import InstanceSnapshot, ModelInstance
from shared.events import InstanceStats, LayerRange, MemoryHolding, MemoryKind, PoolBreakdown, WorkerState, WorkerStats

# The engine's pool kinds → the wire's (the engine says "lora", the catalog "adapter").
_KINDS = {"weights": MemoryKind.WEIGHTS, "prewarm": MemoryKind.PREWARM, "lora": MemoryKind.ADAPTER,
          "kv": MemoryKind.KV, "workspace": MemoryKind.WORKSPACE}
_FIELD = {MemoryKind.WEIGHTS: "weights_bytes", MemoryKind.PREWARM: "prewarm_bytes", MemoryKind.ADAPTER: "adapter_bytes",
          MemoryKind.KV: "kv_bytes", MemoryKind.WORKSPACE: "workspace_bytes"}
_LAYER = re.compile(r":layer(\d+)$")


def pool_breakdown(pairs: list[tuple[str, InstanceSnapshot]]) -> PoolBreakdown:
    """Every instance's pool summed; one holding per (instance, kind, owner), layers where known."""
    totals = {name: 0 for name in _FIELD.values()}
    holdings: list[MemoryHolding] = []
    capacity = 0
    for instance_id, snap in pairs:
        capacity += snap.pool_capacity
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
    used = sum(totals.values())
    return PoolBreakdown(capacity_bytes=capacity, free_bytes=max(0, capacity - used), holdings=holdings, **totals)


class StatsBuilder:
    def __init__(self, worker_id: str, device: str, instances: list[ModelInstance]) -> None:
        self.worker_id = worker_id
        self.device = device
        self.instances = instances
        self.seq = 0
        self._previous: dict[str, InstanceSnapshot] = {}

    def build(self, state: WorkerState, now: float) -> WorkerStats:
        pairs = [(inst.instance_id, inst.snapshot) for inst in self.instances]
        stats: list[InstanceStats] = []
        adapters: set[str] = set()
        for inst, (_, snap) in zip(self.instances, pairs):
            prev = self._previous.get(inst.instance_id)
            growth = tokens_per_s = 0.0
            if prev is not None and snap.ts > prev.ts:
                dt = snap.ts - prev.ts
                growth = (snap.kv_blocks_used - prev.kv_blocks_used) / dt
                tokens_per_s = max(0, snap.tokens_emitted - prev.tokens_emitted) / dt
            if prev is None or snap.ts > prev.ts:
                self._previous[inst.instance_id] = snap
            adapters.update(snap.resident_adapters)
            stats.append(InstanceStats(
                instance_id=inst.instance_id, model=inst.model, layers=LayerRange(start=0, end=inst.num_layers),
                running=snap.running, waiting=snap.waiting + inst.pending, queued_prompt_tokens=snap.queued_prompt_tokens,
                kv_blocks_total=snap.kv_blocks_total, kv_blocks_used=snap.kv_blocks_used, kv_block_bytes=inst.block_bytes,
                kv_growth_blocks_per_s=max(-1e9, min(1e9, growth)), tokens_per_s=tokens_per_s,
                adapters=sorted(inst.adapters),  # registered: what the dispatcher may route here
            ))
        msg = WorkerStats(
            worker_id=self.worker_id, seq=self.seq, ts=now,
            device=self.device, state=state, pool=pool_breakdown(pairs), instances=stats,
            resident_adapters=sorted(adapters),
        )
        self.seq += 1
        return msg

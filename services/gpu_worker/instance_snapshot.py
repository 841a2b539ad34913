"""An instance's load and memory at one moment: `InstanceSnapshot`, made on its engine thread.

`take_snapshot` reads the engine's scheduler, blocks, pool and LoRA state (the engine thread's
own, so no lock) into an immutable value the stats publisher reads from the event loop
(services/gpu_worker/stats.py types it into `WorkerStats`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.gpu_worker.engine.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """The instance's load and memory at one moment (made on the engine thread)."""

    ts: float = 0.0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    kv_blocks_total: int = 0  # the most it could hold: its own + what the shared pool could give it
    kv_blocks_used: int = 0
    kv_blocks_held: int = 0  # held now, used or free (the rest of kv_blocks_total is the pool's or others')
    tokens_emitted: int = 0  # cumulative
    steps: int = 0  # cumulative
    preemptions: int = 0  # cumulative: the scheduler's recompute preemptions
    prefill_tokens: int = 0  # cumulative: prompt tokens computed in prefill chunks ...
    prefill_s: float = 0.0  # ... and the wall time of the steps that held them
    pool_capacity: int = 0
    pool_id: int | None = None  # which pool (instances of a worker share one); None: count it on its own
    pool_by_owner: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> owner -> bytes
    resident_adapters: tuple[str, ...] = ()
    # per request (running and waiting): (request_id, prompt tokens, tokens, KV-computed tokens, KV blocks held,
    # KV blocks at prompt + max_tokens); plain tuples, made cheaply on the engine thread (StatsBuilder types them)
    requests: tuple[tuple[str, int, int, int, int, int], ...] = ()
    # LoRA (CaraServe): ranks of the batch and the queue (0: no adapter), where adapters are warm
    # ((adapter, "device" | "host", pinned, rank, bytes) rows), device room for a new one
    running_ranks: tuple[int, ...] = ()
    waiting_ranks: tuple[int, ...] = ()
    adapter_residency: tuple[tuple[str, str, bool, int, int], ...] = ()
    adapter_room_bytes: int = 0
    resident_layers: tuple[int, int] | None = None  # [first, last + 1) of the layers held (None: not known yet)


def take_snapshot(engine: LLMEngine, *, tokens_emitted: int, steps: int) -> InstanceSnapshot:
    """The engine's state now (call it on the engine thread); `tokens_emitted` and `steps` are the
    instance's cumulative counts."""
    sched, blocks = engine.scheduler, engine.blocks
    queued = sum(s.num_uncomputed_tokens for s in sched.waiting)
    queued += sum(s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1)
    return InstanceSnapshot(
        ts=time.time(), running=len(sched.running), waiting=len(sched.waiting), queued_prompt_tokens=queued,
        kv_blocks_total=blocks.capacity_blocks, kv_blocks_used=blocks.num_used_blocks,
        kv_blocks_held=blocks.num_blocks, pool_id=id(engine.pool.root),
        tokens_emitted=tokens_emitted, steps=steps, preemptions=sched.num_preemptions,
        prefill_tokens=engine.prefill_tokens, prefill_s=engine.prefill_s,
        pool_capacity=engine.pool.capacity_bytes,
        pool_by_owner=engine.pool.by_owner(), resident_adapters=tuple(engine.runner.lora.resident),
        requests=_request_rows(engine), resident_layers=_resident(engine), **_lora_fields(engine),
    )


def _resident(engine: LLMEngine) -> tuple[int, int] | None:
    held = engine.runner.resident_layers()  # a buddy-group member holds fewer than all
    return (held[0], held[-1] + 1) if held else None


def _lora_fields(engine: LLMEngine) -> dict[str, object]:
    lora = engine.runner.lora

    def rank(adapter: str | None) -> int:
        held = lora.host.get(adapter) if adapter is not None else None
        return held.rank if held is not None else 0

    return {"running_ranks": tuple(rank(s.adapter) for s in engine.scheduler.running),
            "waiting_ranks": tuple(rank(s.adapter) for s in engine.scheduler.waiting),
            "adapter_residency": tuple(lora.residency()), "adapter_room_bytes": lora.room_bytes()}


def _request_rows(engine: LLMEngine) -> tuple[tuple[str, int, int, int, int, int], ...]:
    blocks, size = engine.blocks, engine.blocks.block_size
    layers = len(blocks.layers)
    rows = []
    for seq in (*engine.scheduler.running, *engine.scheduler.waiting):
        final = min(seq.num_prompt_tokens + seq.params.max_tokens, engine.max_model_len)
        rows.append((seq.seq_id, seq.num_prompt_tokens, seq.num_tokens, seq.num_computed_tokens,
                     blocks.num_blocks_of(seq.seq_id), -(-final // size) * layers))
    return tuple(rows)

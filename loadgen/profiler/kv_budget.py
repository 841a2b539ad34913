"""A worker pool size that leaves the engine exactly a given KV budget (the pressure fidelity run).

A live worker's KV is whatever its pool (`[[workers]] memory`) has left after the weights, the
step workspace and any adapters: the block manager claims the free bytes as blocks of ONE
layer's K and V for `block_size` tokens (services/gpu_worker/engine/block_manager.py). So the
pool for a budget of `kv_tokens` is those charges plus `kv_tokens / block_size x layers` blocks.
They are read from a real engine built with the same settings as the worker (batch, token
budget and context decide the workspace estimate), not computed from the model's shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class KvBudget:
    pool_bytes: int  # the worker's `memory`
    token_blocks: int  # blocks of every layer: the simulator's `WorkerSpec.kv_blocks`
    layer_blocks: int  # the engine's unit (one layer's block): what the worker's stats report
    block_bytes: int  # one layer's block
    fixed_bytes: int  # weights + workspace + adapters: the pool less its KV


def kv_budget(model_dir: Path, *, kv_tokens: int, block_size: int, max_batch: int, max_batched_tokens: int,
              max_model_len: int, threads: int = 1) -> KvBudget:
    """The pool that gives an engine of these settings `kv_tokens` of KV (rounded down to whole
    blocks); ValueError if that is less than one sequence of `max_model_len` could need."""
    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine

    if kv_tokens < block_size:
        raise ValueError(f"--kv-tokens {kv_tokens} is less than one KV block of {block_size} tokens")
    engine = LLMEngine(EngineConfig(
        model_dir=str(model_dir), pool_bytes=None, block_size=block_size, max_num_seqs=max_batch,
        max_num_batched_tokens=max(max_batched_tokens, max_batch), max_model_len=max_model_len, num_threads=threads,
    ))
    memory = engine.pool.breakdown()
    fixed = sum(int(v) for k, v in memory.items() if k not in ("kv", "free"))
    layers = len(engine.blocks.layers)
    block_bytes = engine.blocks.block_bytes
    token_blocks = kv_tokens // block_size
    need = -(-engine.max_model_len // block_size)
    if token_blocks < need:
        raise ValueError(f"a KV budget of {kv_tokens} tokens ({token_blocks} blocks) cannot hold one request of "
                         f"the context length {engine.max_model_len} ({need} blocks)")
    return KvBudget(pool_bytes=fixed + token_blocks * layers * block_bytes, token_blocks=token_blocks,
                    layer_blocks=token_blocks * layers, block_bytes=block_bytes, fixed_bytes=fixed)


__all__ = ["KvBudget", "kv_budget"]

"""Measure one model on the real engine and build a `CostProfile` for the simulator."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.profiler.fit import fit_error, fit_step_cost
from loadgen.profiler.measure import StepSample, measure_copy, measure_decode, measure_prefill, measure_tcp
from loadgen.sim.profile import CostProfile, LinkSpec, WorkerSpec


@dataclass(frozen=True)
class ProfileSettings:
    name: str
    threads: int = 1
    pool_bytes: int = 1 << 30
    block_size: int = 16
    max_batch: int = 32
    max_batched_tokens: int = 512
    max_model_len: int | None = None
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    contexts: list[int] = field(default_factory=lambda: [32, 128, 384])
    steps: int = 8
    prefill: list[int] = field(default_factory=lambda: [8, 32, 64, 128, 256, 512])
    repeats: int = 3
    request_overhead_s: float = 0.002
    links: bool = True
    # Measure everything this many times and keep each point's fastest pass: other processes on
    # the host only ever add time, so on a shared host the fastest pass is the engine's own cost
    passes: int = 1
    clock: str = "wall"  # or "cpu": the process's CPU seconds per step (measure.py)


def kv_token_blocks(layer_blocks: int, layers: int) -> int:
    """The engine's KV blocks in the simulator's unit. The engine's block is ONE layer's K and V
    for `block_size` tokens and a sequence takes one per held layer at once (all or nothing), so
    `layer_blocks` hold `layer_blocks // layers` blocks of every layer (WorkerSpec.kv_blocks,
    whose bytes per token are all layers'); the remainder is never usable."""
    if layers < 1:
        raise ValueError(f"a model with {layers} KV layers")
    return layer_blocks // layers


def fastest(passes: list[list[StepSample]]) -> list[StepSample]:
    """Per measured point (same features), the sample of the fastest pass."""
    best: dict[tuple[int, int, int, int], StepSample] = {}
    for samples in passes:
        for x in samples:
            key = (x.decode_seqs, x.decode_ctx, x.prefill_tokens, x.prefill_attn)
            if key not in best or x.seconds < best[key].seconds:
                best[key] = x
    return list(best.values())


def profile_engine(model_dir: Path, s: ProfileSettings) -> tuple[CostProfile, list[str]]:
    """The fitted profile and lines describing the fit."""
    import torch

    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    torch.set_num_threads(s.threads)
    config = EngineConfig(
        model_dir=str(model_dir), pool_bytes=s.pool_bytes, block_size=s.block_size, max_num_seqs=s.max_batch,
        max_num_batched_tokens=max(s.max_batched_tokens, s.max_batch), max_model_len=s.max_model_len,
        num_threads=s.threads,
    )
    # the instance start as a running worker pays it (checkpoint read, engine built; wall): a first engine
    # pays this process's one-time costs (imports, kernels, allocator), then the second one is timed
    first = LLMEngine(config)
    del first
    started = time.perf_counter()
    engine = LLMEngine(config)
    start_s = time.perf_counter() - started
    cfg = engine.runner.cfg
    vocab = cfg.vocab_size
    engine.generate([[min(16, vocab - 1)] * 8], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    batches = [b for b in s.batches if b <= s.max_batch]
    prefill = [p for p in s.prefill if p <= s.max_batched_tokens and p < engine.max_model_len]
    if not batches or not prefill:
        raise ValueError("no decode batch within --max-batch or no prefill length within the step budget")
    decode = fastest([measure_decode(engine, batches, s.contexts, s.steps, vocab, clock=s.clock)
                      for _ in range(s.passes)])
    pre = fastest([measure_prefill(engine, prefill, s.repeats, vocab, clock=s.clock) for _ in range(s.passes)])
    samples = decode + pre
    step = fit_step_cost(samples)
    med, worst = fit_error(step, samples)
    memory = engine.stats()["memory"]
    assert isinstance(memory, dict)
    layers = len(list(engine.runner.kv_layers))
    worker = WorkerSpec(
        kv_blocks=kv_token_blocks(engine.blocks.capacity_blocks, layers),
        block_size=s.block_size, kv_bytes_per_token=engine.runner.kv_block_bytes * layers // s.block_size,
        weights_bytes=int(memory.get("weights", 0)), max_batch=s.max_batch,
        max_batched_tokens=max(s.max_batched_tokens, s.max_batch), max_model_len=engine.max_model_len,
    )
    lines = [f"model {cfg.name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {vocab}; "
             f"{s.threads} torch thread(s); instance start {start_s:.2f} s (checkpoint read, engine built, in a warm process)",
             f"{len(decode)} decode points, {len(pre)} prefill points ({s.clock} clock, fastest of {s.passes} pass(es)); fit error median {med:.1%}, max {worst:.1%}"]
    lines += [f"  {name} = {getattr(step, name):.4g}" for name in step.__struct_fields__]
    links = CostProfile().links
    if s.links:
        shm_lat, shm_bw = measure_copy()
        tcp_lat, tcp_bw = measure_tcp()
        measured = [LinkSpec(name="tcp", latency_s=tcp_lat, bandwidth_bytes_per_s=tcp_bw),
                    LinkSpec(name="shm", latency_s=shm_lat, bandwidth_bytes_per_s=shm_bw)]
        kept = [link for link in links if link.name not in ("tcp", "shm")]  # e.g. "disk": not measured here
        links = measured + kept
        lines.append(f"links: tcp {tcp_bw / 1e9:.2f} GB/s + {tcp_lat * 1e6:.0f} us, "
                     f"shm {shm_bw / 1e9:.2f} GB/s + {shm_lat * 1e6:.1f} us (loopback, this host)"
                     + (f"; {', '.join(l.name for l in kept)}: the defaults, not measured" if kept else ""))
    profile = CostProfile(
        name=s.name, description=f"fitted by `tidal profile` from {model_dir} ({s.threads} thread(s))",
        request_overhead_s=s.request_overhead_s, instance_start_s=start_s, step=step, worker=worker, links=links,
    )
    return profile, lines


__all__ = ["ProfileSettings", "fastest", "kv_token_blocks", "profile_engine"]

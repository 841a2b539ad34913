"""What `tidal bench lora` measures before its cluster starts, with the worker's own engine in-process:
the prefill time of a typical prompt (a resident rank-64 adapter, the run's kernel and threads), the
device bytes of a rank-64 adapter, and the fixed pool charges (to size S-LoRA's tight unified pool)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Calibration:
    prefill_s: float  # fastest prefill (+ first token) of `prompt_len` tokens with a resident adapter:
    # the least disturbed by other work on a shared machine (the loads' pacing is not disturbed)
    prefill_median_s: float
    rank64_bytes: int  # a rank-64 adapter's device copy (what a load moves)
    fixed_bytes: int  # weights + workspace charged to the pool
    kv_bytes_per_token: int


def calibrate(model: Path, rank64: Path, *, prompt_len: int, kernel: str, threads: int, repeats: int = 9) -> Calibration:
    import torch

    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.memory_pool import MemoryKind
    from services.gpu_worker.engine.sampling_params import SamplingParams

    from shared.config import PoliciesSection

    pol = PoliciesSection()  # the worker's step shapes (they size its workspace charge)
    before = torch.get_num_threads()
    engine = LLMEngine(EngineConfig(str(model), pool_bytes=1 << 30, block_size=pol.kv_block_tokens,
                                    max_num_seqs=pol.max_batch_size,
                                    max_num_batched_tokens=max(pol.step_token_budget, pol.max_batch_size),
                                    max_model_len=1024, lora_mode=kernel, num_threads=threads))
    try:
        engine.add_lora("calibrate", rank64)
        prompt = [1 + (7 * i) % 1000 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=1, temperature=0)
        times = []
        for i in range(repeats + 2):  # the first two warm up (lazy init, the adapter's first load)
            start = time.perf_counter()
            engine.generate([prompt], params, adapters=["calibrate"])
            if i >= 2:
                times.append(time.perf_counter() - start)
        adapter_bytes = engine.runner.lora.resident["calibrate"][0].nbytes
        runner = engine.runner
        fixed = sum(engine.pool.bytes_of(kind) for kind in (MemoryKind.WEIGHTS, MemoryKind.WORKSPACE))
        return Calibration(min(times), statistics.median(times), adapter_bytes, fixed,
                           runner.kv_block_bytes // engine.config.block_size)
    finally:
        torch.set_num_threads(before)

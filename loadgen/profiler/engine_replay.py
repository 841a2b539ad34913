"""The real engine in process, on a clock of its own CPU seconds: the pressure check without the host.

`engine_replay` runs a trace through a real `LLMEngine` (model forward passes, sampling, its
scheduler and KV blocks) on ONE engine, open loop: requests join when the clock passes their
arrival, and the clock advances by each `engine.step()`'s CPU seconds (`time.process_time`), the
unit the profile is fitted in with `clock="cpu"`. Other processes on a shared host then change
nothing but the wall time it takes, so against the simulator (the engine-only profile, no
serving overheads) it checks the simulator's model of the engine itself when KV runs out — the
step-time model under the run's mix of steps included — apart from the serving path and the
host's contention, which only the live cluster run has. `replay_engine` takes an engine already
built (on a GPU: `tidal bench fidelity --device cuda:0`, on the wall clock of its steps).
"""
from __future__ import annotations

import time
from pathlib import Path

from loadgen.profiler.scheduler_replay import ReplayResult
from loadgen.report.records import RequestRecord
from loadgen.traces.schema import Trace


def engine_replay(model_dir: Path, trace: Trace, *, pool_bytes: int, block_size: int, max_batch: int,
                  max_batched_tokens: int, max_model_len: int, policy: str = "chunked", threads: int = 1) -> ReplayResult:
    import torch

    from services.gpu_worker.engine.engine import EngineConfig, LLMEngine
    from services.gpu_worker.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(
        model_dir=str(model_dir), pool_bytes=pool_bytes, block_size=block_size, max_num_seqs=max_batch,
        max_num_batched_tokens=max(max_batched_tokens, max_batch), max_model_len=max_model_len, num_threads=threads,
        scheduling_policy=policy,
    ))
    vocab = engine.runner.cfg.vocab_size
    engine.generate([[min(16, vocab - 1)] * 8], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    return replay_engine(engine, trace, clock="cpu")


def replay_engine(engine, trace: Trace, *, clock: str = "cpu") -> ReplayResult:  # type: ignore[no-untyped-def]
    """`trace` through a built (and warmed) engine, open loop, on the clock `clock` ("cpu": the
    process's CPU seconds; "wall": each step's wall time, e.g. a GPU step, which ends in the token fetch)."""
    from services.gpu_worker.engine.sampling_params import SamplingParams

    now = {"cpu": time.process_time, "wall": time.perf_counter}[clock]
    vocab = engine.runner.cfg.vocab_size
    recs = sorted(trace.records, key=lambda r: r.arrival_s)
    ids = [r.request_id or f"req-{i}" for i, r in enumerate(recs)]
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    errors: dict[str, str] = {}
    t, i, steps, peak = 0.0, 0, 0, 0.0
    while i < len(recs) or engine.has_unfinished:
        while i < len(recs) and recs[i].arrival_s <= t:
            rec = recs[i]
            prompt = [16 + (i * 7 + j) % (vocab - 16) for j in range(rec.prompt_tokens)]  # distinct prompts
            engine.add_request(ids[i], prompt, SamplingParams(max_tokens=max(1, rec.output_tokens), ignore_eos=True,
                                                              temperature=0))
            i += 1
        if not engine.has_unfinished:
            t = recs[i].arrival_s  # idle until the next arrival
            continue
        start = now()
        outputs = engine.step()
        t += now() - start
        steps += 1
        peak = max(peak, engine.blocks.usage)
        for out in outputs:
            if out.new_token_ids:
                first.setdefault(out.request_id, t)
            if out.finished:
                finish[out.request_id] = t
                if out.finish_reason == "error":
                    errors[out.request_id] = out.error or "error"
    records = [RequestRecord(request_id=rid, model=rec.model, arrival_s=rec.arrival_s, prompt_tokens=rec.prompt_tokens,
                             output_tokens=rec.output_tokens, status="error" if rid in errors else "ok",
                             first_token_s=first.get(rid), finish_s=finish.get(rid, t), error=errors.get(rid))
               for rid, rec in zip(ids, recs)]
    return ReplayResult(records=records, preemptions=engine.scheduler.num_preemptions, steps=steps, kv_peak=peak)


__all__ = ["engine_replay", "replay_engine"]

"""An engine step split in two for pipelined micro-batches: schedule now, sample later.

In a buddy group the owner of a request (the member its dispatcher admitted it to) keeps
its scheduler, sampler and detokenizer; the forward of a micro-batch runs stage by stage
on the members and its logits come back later. Meanwhile the owner schedules the next
micro-batch from sequences that are not in flight (a sequence is in one micro-batch at a
time: its next token depends on the last). The seeded sampler draws by (seed, output
index), so tokens do not depend on how the steps were batched.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection

import torch

from services.gpu_worker.engine.batch import SchedulerOutput
from services.gpu_worker.engine.engine import LLMEngine
from services.gpu_worker.engine.outputs import RequestOutput
from services.gpu_worker.engine.sampler import SampleResult
from services.gpu_worker.engine.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


def schedule_excluding(engine: LLMEngine, in_flight: Collection[str]) -> SchedulerOutput:
    """The engine's next micro-batch from the sequences not in `in_flight`. In-flight
    sequences are neither scheduled nor preempted (their KV is being read), and count
    toward the batch cap."""
    sched = engine.scheduler
    held = [s for s in sched.running if s.seq_id in in_flight]
    config = sched.config
    if held:
        sched.running = [s for s in sched.running if s.seq_id not in in_flight]
        sched.config = dataclasses.replace(config, max_num_seqs=max(1, config.max_num_seqs - len(held)))
    try:
        out = sched.schedule()
    finally:
        sched.running.extend(held)
        sched.config = config
    engine.stalled = out.is_empty and bool(engine._requests)
    engine._load_adapters(out)
    for seq_id in out.finished:
        engine.sampler.forget(seq_id)
    return out


def complete_micro_batch(
    engine: LLMEngine, out: SchedulerOutput, logits: torch.Tensor | None, seq_ids: list[str]
) -> list[RequestOutput]:
    """Sample the micro-batch's logits (rows: `seq_ids`), advance its sequences, and return
    the outputs (plus aborts pending since the last step), as `LLMEngine.step` does."""
    engine._sampled_ids = list(seq_ids)
    if logits is None or not seq_ids:
        sampled = SampleResult([])
    else:
        # a row of a request aborted meanwhile is drawn greedily and dropped by `update`
        seqs = [engine._requests[s].seq if s in engine._requests else None for s in seq_ids]
        params = [seq.params if seq is not None else _GREEDY for seq in seqs]
        indices = [seq.num_output_tokens if seq is not None else 0 for seq in seqs]
        outputs = [seq.output_token_ids if seq is not None else [] for seq in seqs]
        prompts = [seq.prompt_token_ids if seq is not None else [] for seq in seqs]
        sampled = engine.sampler.sample(logits, seq_ids, params, indices, outputs, prompts)
    changed = engine.scheduler.update(out, sampled.token_ids)
    return engine._postprocess(changed, sampled)

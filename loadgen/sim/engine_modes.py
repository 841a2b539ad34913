"""The "vllm-0.6" engine mode of the simulated worker: how the papers' baselines scheduled a step.

KunServe and Llumnix ran vLLM 0.6 (Llumnix pins 0.6.3) with its defaults: chunked prefill off,
so `Scheduler._schedule_default` builds each step as ONE of
- a prefill step: waiting requests admitted FCFS, each with its WHOLE prompt (blocks for all of
  it allocated at once), while the step's token budget (`max_num_batched_tokens`), the batch cap
  (`max_num_seqs`, counting the running requests) and the KV blocks allow; a request is admitted
  only if the free blocks left after it stay at or above the watermark (`watermark`, 0.01 of the
  blocks). Prefill-first: whenever at least one request can be admitted, the step is prefill
  only and no running request decodes in it;
- a decode step, when nothing could be admitted: every running request decodes one token; when a
  request needs a block and none is free, the newest running request is preempted by recompute
  (its KV freed, it goes back to the waiting queue with prompt + generated tokens to prefill).
So under overload, decodes starve while prompts are admitted, KV runs out, and recompute
preemptions follow: the "waiting for memory" tail that extra KV memory fixes.

Sources: vLLM v0.6.3 vllm/core/scheduler.py (`_schedule_default`, `_schedule_prefills`,
`_schedule_running`, `_preempt_by_recompute`) and vllm/core/block_manager_v1.py (`can_allocate`
with `watermark_blocks`); its defaults in vllm/config.py / engine/arg_utils.py (watermark 0.01,
enable_chunked_prefill False for these models).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the worker passes itself in; no import at run time (no circle)
    from loadgen.sim.worker import SimWorker


def plan_prefill_first(w: SimWorker, now: float) -> float | None:
    """The next step of a vllm-0.6 worker `w` at `now`: its end time, or None when idle."""
    spec = w.spec
    watermark = int(spec.watermark * w.total)
    budget = spec.max_batched_tokens
    seqs = w.decoding + len(w.prefilling)
    free = w.total - w.used
    chunks = []
    extra_s = 0.0
    w.blocked_on = "compute"
    while w.waiting:
        req = w.waiting[0]
        nb = w._blocks(req.to_prefill)
        if w.total - nb < watermark:  # vLLM's AllocStatus.NEVER: the prompt's blocks could never fit
            w._fail_waiting_head(now)
            continue
        if req.to_prefill > spec.max_batched_tokens:  # vLLM ignores a prompt over its prompt limit
            w.waiting.popleft()
            w.queued_tokens -= req.to_prefill
            w._fail(req, now, f"prompt of {req.to_prefill} tokens exceeds the step budget "
                              f"max_num_batched_tokens={spec.max_batched_tokens} (no chunked prefill)")
            continue
        if seqs >= spec.max_batch or req.to_prefill > budget:
            break  # waits for compute: the batch or the step's token budget is full
        if free - nb < watermark:
            w.blocked_on = "memory"  # AllocStatus.LATER: FCFS, later arrivals do not overtake
            break
        w.waiting.popleft()
        w.prefilling.append(req)
        if req.adapter is not None:
            extra_s += w._use_adapter(req.adapter)
        w.used += nb
        free -= nb
        budget -= req.to_prefill
        seqs += 1
        chunks.append((req, req.to_prefill, nb))
    if chunks:
        w.run_blocks = 0
        w.run_prefill_only = True
        return w._start_chunks(now, chunks, 0, 0, extra_s)
    preempted = w._preempt_for_decode(now)
    if preempted:
        w.blocked_on = "memory"
    return w._plan_decode_run(now, preempted)


__all__ = ["plan_prefill_first"]

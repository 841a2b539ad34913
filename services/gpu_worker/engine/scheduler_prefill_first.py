"""The "vllm-0.6" scheduling policy: one step built as vLLM 0.6 built it for the papers' baselines
(KunServe, Llumnix: vLLM 0.6 with chunked prefill off). No torch.

A step is ONE of
- a prefill step: waiting sequences admitted FCFS, each with ALL its uncomputed tokens (the
  prompt, or prompt + outputs after a preemption) in this step, while the token budget
  (`max_num_batched_tokens`), the batch cap (`max_num_seqs`, the running sequences counted) and
  the KV blocks allow; a sequence is admitted only if the blocks left free after it stay at or
  above the watermark (`SchedulerConfig.watermark` of the blocks). Prefill-first: when anything
  is admitted, no running sequence decodes in that step;
- a decode step, when nothing could be admitted: every running sequence (oldest first) gets its
  next token; when one needs a block and none is free, the newest running sequence is preempted
  by recompute (KV freed, back to the waiting queue) until it fits — possibly itself.
Under overload decodes stall while prompts are admitted, KV runs out and recompute preemptions
follow. The simulator's "vllm-0.6" engine mode (loadgen/sim/engine_modes.py) is the same policy.

Sources (vLLM v0.6.3): vllm/core/scheduler.py `_schedule_default` (prefills first; running only
when no prefill was scheduled), `_schedule_prefills` (FCFS, `can_allocate` LATER stops the queue,
NEVER ignores the request, `budget.can_schedule`), `_schedule_running` (`can_append_slots`, else
`_preempt` the last of `running`, recompute for single sequences); block manager v2 (the default
since v0.6.2, vllm PR #8704): `can_allocate` with `watermark_blocks = watermark x total blocks`,
`can_append_slots` counting the blocks the new tokens touch. vLLM's SchedulerConfig refuses a
token budget below the context length without chunked prefill; so does ours (SchedulerConfig).

Blocks: ours are per layer (block_manager), so the watermark is whole blocks of every layer,
`int(watermark x capacity / layers)` of them, as the simulator counts it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from services.gpu_worker.engine.batch import ScheduledChunk, SchedulerOutput
from services.gpu_worker.engine.sequence import SequenceStatus

if TYPE_CHECKING:  # the scheduler passes itself in; no import at run time (no circle)
    from services.gpu_worker.engine.scheduler import Scheduler


def watermark_blocks(sched: Scheduler) -> int:
    """Blocks (the engine's per-layer unit) an admission must leave free."""
    layers = max(1, len(sched.blocks.layers))
    return int(sched.config.watermark * sched.blocks.capacity_blocks / layers) * layers


def schedule_prefill_first(sched: Scheduler, out: SchedulerOutput) -> dict[str, ScheduledChunk]:
    """This step's chunks under the vllm-0.6 policy (preemptions are recorded in `out`)."""
    scheduled = _admit_whole_prompts(sched)
    if scheduled:
        return scheduled
    return _decode_all(sched, out)


def _admit_whole_prompts(sched: Scheduler) -> dict[str, ScheduledChunk]:
    cfg, blocks = sched.config, sched.blocks
    budget = cfg.max_num_batched_tokens
    capacity = blocks.capacity_blocks
    watermark = watermark_blocks(sched)
    free = capacity - blocks.num_used_blocks
    scheduled: dict[str, ScheduledChunk] = {}
    while sched.waiting:
        seq = sched.waiting[0]
        hit = sched.attach_prefix(seq)  # cached prefix blocks: counted once, not in `need`
        n = seq.num_uncomputed_tokens
        need = blocks.blocks_needed(seq.seq_id, seq.num_computed_tokens + n)
        if capacity - need - blocks.num_blocks_of(seq.seq_id) < watermark:  # vLLM's AllocStatus.NEVER
            sched.detach_prefix(seq, hit)
            sched._never_fits(seq, seq.num_computed_tokens + n)
            continue
        if len(sched.running) >= cfg.max_num_seqs or n > budget or free - need < watermark:
            sched.detach_prefix(seq, hit)  # waits for compute (batch, token budget) or AllocStatus.LATER (FCFS)
            break
        if not blocks.allocate(seq.seq_id, seq.num_computed_tokens + n, sched._expected(seq)):
            sched.detach_prefix(seq, hit)
            break  # the shared pool could not give them after all
        sched.admitted_prefix(hit)
        free = capacity - blocks.num_used_blocks
        sched.waiting.pop(0)
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        scheduled[seq.seq_id] = sched._chunk(seq, n)
        budget -= n
    return scheduled


def _decode_all(sched: Scheduler, out: SchedulerOutput) -> dict[str, ScheduledChunk]:
    budget = sched.config.max_num_batched_tokens
    scheduled: dict[str, ScheduledChunk] = {}
    sched.running.sort(key=lambda s: s.sort_key)
    for seq in list(sched.running):
        if budget == 0:
            break
        if seq.status is not SequenceStatus.RUNNING:
            continue  # preempted earlier in this loop
        n = sched._chunk_len(seq, budget)  # 1, unless it was attached part-computed (a migration)
        while not sched.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n, sched._expected(seq)):
            victim = max(sched.running, key=lambda s: s.sort_key)  # the newest (lowest priority)
            if victim is seq and not sched._fits_at_all(seq, seq.num_computed_tokens + n):
                sched._never_fits(seq, seq.num_computed_tokens + n)
                break
            budget += sched._preempt(victim, scheduled, out)
            if victim is seq:
                break
        else:
            scheduled[seq.seq_id] = sched._chunk(seq, n)
            budget -= n
    return scheduled


__all__ = ["schedule_prefill_first", "watermark_blocks"]

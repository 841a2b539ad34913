"""Continuous batching with chunked prefill, a token budget and a batch cap. No torch.

Each step: running sequences that decode go first (one token each), then running
sequences still prefilling take chunks, then waiting sequences are admitted in
(priority, arrival) order while the token budget, the batch cap (KunServe §4.3) and the
KV blocks allow. When a running sequence needs a block and none is free, the
lowest-priority, latest-arrived running sequence is preempted (its KV is freed and it is
recomputed later). The runner's contract is `batch.SchedulerOutput`.

That is the "chunked" policy, the default. `SchedulerConfig.policy = "vllm-0.6"` builds each step
as vLLM 0.6 did for the papers' baselines instead (scheduler_prefill_first.py: prefill-first,
whole prompts, an admission watermark, recompute preemption of the newest); docs/engine-scheduling.md.

When the worker's instances share one pool, "no block is free" means none is free here
nor claimable from the pool (free bytes, other instances' free blocks): the rules above
then apply unchanged — another instance's live KV is never taken. A waiting sequence
waits; what it lacks is filed as this instance's want at the end of the step
(`BlockManager.settle`), so blocks the other instances free go to it first. A request
fails as too long only if it could not fit even with every KV byte of the pool
(`capacity_blocks`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from services.gpu_worker.engine.batch import ScheduledChunk, SchedulerOutput
from services.gpu_worker.engine.block_manager import BlockManager
from services.gpu_worker.engine.scheduler_prefill_first import schedule_prefill_first
from services.gpu_worker.engine.sequence import FinishReason, Sequence, SequenceStatus


POLICIES = ("chunked", "vllm-0.6")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # the maximum batch: running sequences at once
    max_num_batched_tokens: int = 1024  # per-step token budget (decode tokens + prefill chunks)
    max_model_len: int = 2048  # context length: prompt + outputs
    max_prefill_chunk: int = 0  # cap on one sequence's prefill chunk; 0 = the remaining budget
    policy: str = "chunked"  # how a step is built: one of POLICIES
    watermark: float = 0.01  # vllm-0.6: fraction of the KV blocks an admission leaves free (vLLM's default)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.policy == "vllm-0.6" and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(  # vLLM 0.6's own check (SchedulerConfig._verify_args): no chunked prefill
                f"the vllm-0.6 policy prefills whole prompts, so max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.max_model_len < 1 or self.max_prefill_chunk < 0:
            raise ValueError(f"bad max_model_len/max_prefill_chunk: {self.max_model_len}/{self.max_prefill_chunk}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        self._errored: list[Sequence] = []  # could never fit; returned by the next update()
        self._between_steps = SchedulerOutput()  # preemptions outside schedule(), reported next
        self.num_preemptions = 0

    # --- requests in and out ---------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"request id {seq.seq_id!r} is already in the engine")
        if seq.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {seq.seq_id}: prompt has {seq.num_prompt_tokens} tokens, "
                f"more than the context length {self.config.max_model_len}"
            )
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=_key)

    def attach(self, seq: Sequence) -> None:
        """Admit a sequence whose first `num_computed_tokens` tokens' KV is already in its
        blocks (a live migration's destination): it runs from the next step, continuing from
        there. It joins the running set at once, even if that briefly exceeds max_num_seqs:
        its KV must not sit idle behind the waiting queue."""
        if seq.num_computed_tokens == 0:
            return self.add(seq)
        if seq.seq_id in self._seqs:
            raise ValueError(f"request id {seq.seq_id!r} is already in the engine")
        if not 0 < seq.num_computed_tokens < seq.num_tokens or seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {seq.seq_id}: {seq.num_computed_tokens} computed of {seq.num_tokens} tokens "
                f"(context length {self.config.max_model_len}): nothing left to compute, or too long"
            )
        seq.status = SequenceStatus.RUNNING
        self._seqs[seq.seq_id] = seq
        self.running.append(seq)

    def detach(self, seq_id: str, *, free_blocks: bool) -> Sequence | None:
        """Take a sequence out WITHOUT finishing it (it continues elsewhere): nothing is
        reported; its blocks are freed, or left in the block manager under its id, outside
        the scheduler's reach, for the caller."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if free_blocks:
            self.blocks.free(seq_id)
        return seq

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish a request now: its blocks are free before the next step."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)
        return seq

    def finish(
        self, seq_id: str, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None
    ) -> Sequence | None:
        """Finish from outside the scheduler (e.g. the detokenizer saw a stop string)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, reason, stop_reason, error)
        return seq

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish(reason, stop_reason if stop_reason is not None else seq.stop_reason, error)
        self.blocks.free(seq.seq_id)
        del self._seqs[seq.seq_id]
        self._finished_ids.append(seq.seq_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.blocks.sync_with_pool()  # bytes released since the last step become blocks now
        out = SchedulerOutput(preempted=self._between_steps.preempted, finished=self._finished_ids)
        self._finished_ids = []
        self._between_steps = SchedulerOutput()
        if self.config.policy == "vllm-0.6":
            scheduled = schedule_prefill_first(self, out)
        else:
            scheduled = self._schedule_chunked(out)
        out.chunks = list(scheduled.values())
        out.finished.extend(s.seq_id for s in self._errored)
        self.blocks.settle()  # what this step lacked becomes a want on the shared pool
        return out

    def _schedule_chunked(self, out: SchedulerOutput) -> dict[str, ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}

        self.running.sort(key=_key)
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        preempted_any = False
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk_len(seq, budget)
            while not self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n, self._expected(seq)):
                victim = max(self.running, key=_key)  # lowest priority, latest arrival
                if victim is seq and not self._fits_at_all(seq, seq.num_computed_tokens + n):
                    self._never_fits(seq, seq.num_computed_tokens + n)
                    break
                budget += self._preempt(victim, scheduled, out)
                preempted_any = True
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = self._chunk(seq, n)
                budget -= n

        # Admit waiting sequences unless this step had to preempt (they would thrash).
        while self.waiting and budget > 0 and not preempted_any and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self.attach_prefix(seq)
            n = self._chunk_len(seq, budget)
            if not self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n, self._expected(seq)):
                self.detach_prefix(seq, hit)
                if not self._fits_at_all(seq, seq.num_computed_tokens + n):
                    self._never_fits(seq, seq.num_computed_tokens + n)
                    continue
                break  # FCFS: later arrivals do not overtake (no starvation of long prompts)
            self.admitted_prefix(hit)
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = self._chunk(seq, n)
            budget -= n
        return scheduled

    # --- prefix caching (prefix_cache.py) --------------------------------------------
    def attach_prefix(self, seq: Sequence) -> tuple[int, int]:
        """Before admitting a sequence with no KV: its cached leading blocks become its first
        blocks and computed tokens, so admission allocates (and counts) only the rest: a hit's
        blocks are counted once, however many sequences share them. (queried, hit) blocks."""
        if self.blocks.prefix is None or seq.num_computed_tokens:
            return 0, 0
        queried, hit = self.blocks.attach_prefix(seq)
        seq.num_computed_tokens = hit * self.blocks.block_size
        return queried, hit

    def detach_prefix(self, seq: Sequence, hit: tuple[int, int]) -> None:
        """The admission failed: give the pinned prefix back (cached-free again)."""
        if hit[1]:
            self.blocks.free(seq.seq_id)
            seq.num_computed_tokens = 0

    def admitted_prefix(self, hit: tuple[int, int]) -> None:
        if self.blocks.prefix is not None:
            self.blocks.prefix.record(*hit)

    def _expected(self, seq: Sequence) -> int:
        """Tokens the sequence may reach: lets the block allocator keep its chains contiguous."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_uncomputed_tokens, budget)
        if self.config.max_prefill_chunk and n > 1:
            n = min(n, self.config.max_prefill_chunk)
        return n

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids(start, start + n),
            start_pos=start,
            block_tables=self.blocks.block_tables(seq.seq_id),
            adapter=seq.adapter,
            sample=start + n == seq.num_tokens,
        )

    def _preempt(self, seq: Sequence, scheduled: dict[str, ScheduledChunk], out: SchedulerOutput) -> int:
        """Free a running sequence's KV and queue it for recompute; returns budget given back."""
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.reset_for_recompute()
        bisect.insort(self.waiting, seq, key=_key)
        out.preempted.append(seq.seq_id)
        self.num_preemptions += 1
        chunk = scheduled.pop(seq.seq_id, None)
        return len(chunk.token_ids) if chunk else 0

    def preempt(self, seq_id: str) -> bool:
        """Preempt one running sequence now (its KV is freed; recomputed when rescheduled)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.status is not SequenceStatus.RUNNING:
            return False
        self._preempt(seq, {}, self._between_steps)
        return True

    def preempt_lowest(self) -> Sequence | None:
        """Preempt the lowest-priority running sequence now (to free KV for something else)."""
        if not self.running:
            return None
        victim = max(self.running, key=_key)
        self._preempt(victim, {}, self._between_steps)
        return victim

    def _fits_at_all(self, seq: Sequence, num_tokens: int) -> bool:
        """Could this sequence hold `num_tokens` if it had every KV block the pool could give?"""
        need = self.blocks.blocks_needed(seq.seq_id, num_tokens) + self.blocks.num_blocks_of(seq.seq_id)
        return need <= self.blocks.capacity_blocks

    def _never_fits(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks.blocks_needed(seq.seq_id, num_tokens) + self.blocks.num_blocks_of(seq.seq_id)
        self._finish(
            seq,
            FinishReason.ERROR,
            error=f"request {seq.seq_id} needs {need} KV blocks for {num_tokens} tokens; "
            f"this engine could hold at most {self.blocks.capacity_blocks}",
        )
        self._finished_ids.pop()  # reported in this step's output instead
        self._errored.append(seq)

    # --- after the step ----------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Advance counters, append sampled tokens (one per chunk with sample=True, in order),
        apply stop conditions and free finished sequences. Returns the sequences that got a
        token this step (finished ones included), plus those that errored while scheduling."""
        n_sample = sum(1 for c in output.chunks if c.sample)
        if len(sampled) != n_sample:
            raise ValueError(f"update: {len(sampled)} sampled tokens for {n_sample} chunks that sample")
        changed: list[Sequence] = self._errored
        self._errored = []
        tokens = iter(sampled)
        for chunk in output.chunks:
            token = next(tokens) if chunk.sample else None
            seq = self._seqs.get(chunk.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule and update
            seq.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            if self.blocks.prefix is not None:
                self.blocks.commit_prefix(seq)
            if token is None:
                continue
            reason = seq.append_token(token, self.config.max_model_len)
            changed.append(seq)
            if reason is not None:
                self._finish(seq, reason)
        return changed

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
            "kv_usage": self.blocks.usage,
            **self.blocks.stats(),
        }


def _key(seq: Sequence) -> tuple[int, float, int]:
    return seq.sort_key

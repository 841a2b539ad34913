"""The scheduler → runner contract: what one engine step computes.

The scheduler (pure Python, no torch) produces a SchedulerOutput; the model runner
turns it into tensors and runs the model. Nothing else passes between them.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step: a prefill chunk, or the single decode token."""

    seq_id: str
    token_ids: list[int]  # tokens computed this step
    start_pos: int  # position of token_ids[0] (= computed tokens before this step)
    # layer index -> block ids covering positions [0, start_pos + len(token_ids)).
    # Only the layers whose KV this engine holds appear. The lists are the block
    # manager's own (read-only for the runner).
    block_tables: dict[int, list[int]]
    adapter: str | None = None  # LoRA adapter name, None for the base model
    sample: bool = True  # chunk reaches the end of the known tokens: sample a next token
    lora_on_cpu: bool = False  # its adapter is still loading: CPU helpers compute its LoRA deltas


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # KV freed; recomputed when rescheduled
    finished: list[str] = field(default_factory=list)  # finished or aborted since the last step

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

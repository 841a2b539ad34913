"""One request's state inside the engine, kept as counters rather than modes.

A sequence is "prefilling" or "decoding" only by how `num_computed_tokens` compares
with `num_tokens`; a preempted sequence simply has its computed count reset to zero and
is recomputed (prompt and the outputs so far) when it is scheduled again.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.gpu_worker.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting for recompute)
    RUNNING = "running"  # owns KV blocks and is scheduled each step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # aborted by the caller
    ERROR = "error"  # can never run here (e.g. needs more KV than the pool can hold)


@dataclass(slots=True)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    arrival_order: int  # tie-breaker among equal (priority, arrival_time)
    priority: int = 0  # lower number = more urgent
    adapter: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this engine's blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.seq_id}: the prompt has no tokens")

    # --- counters ---------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: priority first, then arrival (FCFS)."""
        return (self.priority, self.arrival_time, self.arrival_order)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + outputs, without copying both lists."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    # --- transitions --------------------------------------------------------------
    def reset_for_recompute(self) -> None:
        """Preemption: the KV is gone; everything known is computed again later."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def append_token(self, token_id: int, max_model_len: int) -> FinishReason | None:
        """Add a sampled token and return why the sequence stops now, if it does."""
        self.output_token_ids.append(token_id)
        params = self.params
        n_out = len(self.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return FinishReason.STOP
        if n_out >= params.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

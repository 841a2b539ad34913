"""What the engine hands back: per-step deltas of each request, and whole offline completions."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one step: only what is new since the previous output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string
    logprobs: list[float] | None = None  # of the new tokens, when the request asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # all outputs so far (usage counter)
    num_preemptions: int = 0
    error: str | None = None


@dataclass(slots=True)
class CompletionResult:
    """A finished request, assembled from its deltas (offline `generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.text += delta.new_text
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error = delta.error

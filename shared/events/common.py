"""Values used by several subject families: layer ranges, sampling parameters, usage, logprobs."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import MAX_LAYERS, MAX_OUTPUT_TOKENS, Count, InstanceId, TokenId, Value, WorkerId

Layer = Annotated[int, Meta(ge=0, le=MAX_LAYERS)]
StopString = Annotated[str, Meta(min_length=1, max_length=256)]
Logprob = Annotated[float, Meta(le=0)]


class LayerRange(Value, kw_only=True):
    """Decoder layers `[start, end)` of a model (half-open, end > start)."""

    start: Layer
    end: Layer

    def __post_init__(self) -> None:
        if self.end <= self.start:
            raise ValueError(f"layer range must have end > start, got [{self.start}, {self.end})")

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end


GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
MAX_GUIDED_SPEC = 1 << 20  # a schema or grammar's text


class TokenBias(Value, kw_only=True):
    """A value added to one token's logit before sampling (OpenAI's logit_bias entry)."""

    token_id: TokenId
    bias: Annotated[float, Meta(ge=-100, le=100)]


class Guided(Value, kw_only=True):
    """A constraint on the output the sampler enforces with a grammar, token by token: `spec` is a JSON
    schema (json_schema), a regular expression (regex), a JSON list of strings (choice) or a Lark
    grammar (lark); json_object takes any JSON object (spec unused)."""

    kind: GuidedKind
    spec: Annotated[str, Meta(max_length=MAX_GUIDED_SPEC)] = ""


class SamplingParams(Value, kw_only=True):
    """How one request picks tokens and when it stops (mirrors the engine's SamplingParams)."""

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)] = 16
    temperature: Annotated[float, Meta(ge=0, le=2)] = 1.0  # 0 = greedy
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=1_000_000)] = 0  # 0 = whole vocabulary
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None  # same seed, same tokens, any batch
    stop: Annotated[list[StopString], Meta(max_length=16)] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = []
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_OUTPUT_TOKENS)] = 0
    # None: no logprobs; 0: the chosen token's; N: also the top N alternatives
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's and vLLM's sampling controls (0 / 1.0 / []: off)
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0, le=10)] = 1.0
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    logit_bias: Annotated[list[TokenBias], Meta(max_length=1024)] = []
    guided: Guided | None = None  # structured output: the grammar every output token must follow

    def __post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")


class Usage(Value, kw_only=True):
    """Token counts of one request (on its final chunk)."""

    prompt_tokens: Count
    completion_tokens: Count
    cached_prompt_tokens: Count = 0  # prompt tokens whose KV was reused, not recomputed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TopLogprob(Value, kw_only=True):
    token_id: TokenId
    logprob: Logprob


class TokenLogprobs(Value, kw_only=True):
    """The chosen token's logprob and, if asked for, the top alternatives."""

    token_id: TokenId
    logprob: Logprob
    top: Annotated[list[TopLogprob], Meta(max_length=20)] = []


class GroupMember(Value, kw_only=True):
    """One instance in a buddy group and the decoder layers whose weights it keeps."""

    worker_id: WorkerId
    instance_id: InstanceId
    layers: LayerRange


__all__ = [
    "GroupMember",
    "Guided",
    "GuidedKind",
    "LayerRange",
    "SamplingParams",
    "TokenBias",
    "TokenLogprobs",
    "TopLogprob",
    "Usage",
]

"""`POST /v1/completions` bodies (OpenAI's legacy completions API, plus vLLM's common extras)."""
from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from services.gateway.api_common import (
    ChoiceCount, FinishReason, MaxTokens, MinP, MinTokens, ModelField, Penalty, RepetitionPenalty, Seed, Stop,
    StopTokenIds, StreamOptions, Temperature, TokenIdField, TopK, TopP, UsageInfo,
)
from services.gateway.api_refused import RefusedCompletionFields
from services.gateway.api_tools import LogitBias, ResponseFormat, StructuredOutputs
from shared.events.base import MAX_PROMPT_TOKENS

MAX_PROMPTS = 128  # prompts in one request (a list of strings or of token-id lists)

# A string, a list of strings (one choice per prompt), a list of token ids, or a list of token-id lists.
# (msgspec allows one array type per union, so the list's items are a union and one bound covers both a
# list of prompts and one prompt's ids: the type allows the wire's longest prompt, and `prep` applies
# MAX_PROMPTS to a list of prompts and max_prompt_tokens / the model's context to each prompt.)
PromptItem = (Annotated[str, Meta(max_length=1 << 20)] | TokenIdField
              | Annotated[list[TokenIdField], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)])
Prompt = Annotated[str, Meta(max_length=1 << 20)] | Annotated[list[PromptItem], Meta(
    min_length=1, max_length=MAX_PROMPT_TOKENS,
    description=f"A string, token ids, or a list of at most {MAX_PROMPTS} strings or token-id lists.")]


class CompletionRequest(RefusedCompletionFields, kw_only=True, forbid_unknown_fields=True):  # type: ignore[misc,valid-type]
    """Every optional field takes `null` as unset."""

    model: ModelField
    prompt: Prompt
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None  # default 1
    top_p: TopP | None = None  # default 1
    top_k: TopK | None = None
    min_p: MinP | None = None
    n: ChoiceCount | None = None  # default 1
    best_of: ChoiceCount | None = None  # >= n: the n of best_of samples with the highest cumulative logprob
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20, description="Chosen token's logprob plus N alternatives.")] | None = None
    echo: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None  # accepted for OpenAI clients; not used
    # vLLM extras
    min_tokens: MinTokens | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Meta(max_length=1 << 16)] | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1, max_length=1024)] | None = None
    guided_grammar: Annotated[str, Meta(max_length=1 << 16)] | None = None  # Lark
    structured_outputs: StructuredOutputs | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = []


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


# --- streaming: `data: <CompletionChunk>` events; fields without a value are left out ---
class CompletionChunkChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: UsageInfo | None = None


__all__ = [
    "CompletionChoice", "CompletionChunk", "CompletionChunkChoice", "CompletionLogprobs", "CompletionRequest",
    "CompletionResponse", "MAX_PROMPTS", "Prompt",
]

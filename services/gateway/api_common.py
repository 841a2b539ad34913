"""HTTP bodies shared by the OpenAI endpoints: errors, usage, stream options, the model list.

These msgspec Structs are the wire format of the HTTP API *and* the source of its OpenAPI
spec (Litestar generates `/openapi.json` from them), so their constraints are the documented
ones. Unknown request fields are refused with a 400 naming them (api_refused.py lists the known
ones this server does not implement); `null` is "unset" for every optional field.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.events.base import MAX_OUTPUT_TOKENS

ModelField = Annotated[
    str, Meta(min_length=1, max_length=256, description="A base model or a LoRA adapter name (see GET /v1/models).")
]
MaxTokens = Annotated[
    int, Meta(ge=1, le=MAX_OUTPUT_TOKENS, description="Tokens to generate at most; default: what the context leaves.")
]
Temperature = Annotated[float, Meta(ge=0, le=2, description="0 is greedy.")]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1, le=1_000_000, description="-1 or 0: the whole vocabulary.")]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1, description="Same seed, same tokens.")]
ChoiceCount = Annotated[int, Meta(ge=1, le=128, description="Choices per prompt (bounded by the gateway's max_n).")]
StopText = Annotated[str, Meta(min_length=1, max_length=256)]
Stop = StopText | Annotated[list[StopText], Meta(max_length=16)] | None
TokenIdField = Annotated[int, Meta(ge=0, lt=2**31)]
StopTokenIds = Annotated[list[TokenIdField], Meta(max_length=64)]
MinTokens = Annotated[int, Meta(ge=0, le=MAX_OUTPUT_TOKENS)]
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


Penalty = Annotated[float, Meta(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Meta(gt=0, le=10, description="vLLM's: > 1 discourages repeats.")]
MinP = Annotated[float, Meta(ge=0, le=1)]


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool | None = None  # a last chunk with empty `choices` and the request's usage
    continuous_usage_stats: bool | None = None  # vLLM's usage on every chunk: refused (400) when true


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every error, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorBody


class AdapterResidencyCard(msgspec.Struct, kw_only=True):
    """Workers where an adapter is held, by level: "device" (ready for the batch), "host" (one copy
    away), "pinned" (on the device and never evicted by LRU). A worker in none has it cold."""

    device: list[str] = []
    host: list[str] = []
    pinned: list[str] = []


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "tidal"
    parent: str | None = None  # a LoRA adapter's base model; None for a base model
    max_model_len: int | None = None
    residency: AdapterResidencyCard | None = None  # an adapter's: workers where it is warm (docs/caraserve.md)


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard] = []


class HealthBody(msgspec.Struct, kw_only=True):
    status: Literal["ok", "ready", "draining", "not_ready"]
    detail: str = ""


__all__ = [
    "AdapterResidencyCard", "ChoiceCount", "ErrorBody", "ErrorResponse", "FinishReason", "HealthBody", "MaxTokens", "MinTokens", "ModelCard",
    "MinP", "ModelField", "ModelList", "Penalty", "RepetitionPenalty", "Seed", "Stop", "StopTokenIds", "StreamOptions", "Temperature", "TopK", "TopP",
    "UsageInfo",
]

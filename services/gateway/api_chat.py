"""`POST /v1/chat/completions` bodies (OpenAI's chat API, text content, plus vLLM's common extras)."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from services.gateway.api_common import (
    ChoiceCount, FinishReason, MaxTokens, MinTokens, ModelField, Seed, Stop, StopTokenIds, StreamOptions, Temperature,
    TopK, TopP, UsageInfo,
)

Role = Literal["system", "developer", "user", "assistant", "tool"]
Text = Annotated[str, Meta(max_length=1 << 20)]


class TextPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only text is served (no images or audio)."""

    type: Literal["text"]
    text: Text


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Role
    content: Text | Annotated[list[TextPart], Meta(max_length=256)] | None = None
    name: Annotated[str, Meta(max_length=256)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    model: ModelField
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=4096)]
    max_tokens: MaxTokens | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK | None = None
    n: ChoiceCount = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    # vLLM extras
    min_tokens: MinTokens = 0
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds = []
    add_generation_prompt: bool = True


class TopLogprobEntry(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobEntry(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobEntry] = []


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[LogprobEntry] | None = None


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str = ""


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


# --- streaming: `data: <ChatCompletionChunk>` events; fields without a value are left out ---
class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


__all__ = [
    "AssistantMessage", "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionRequest",
    "ChatCompletionResponse", "ChatDelta", "ChatLogprobs", "ChatMessage", "LogprobEntry", "TextPart",
    "TopLogprobEntry",
]

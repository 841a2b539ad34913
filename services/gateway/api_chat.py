"""`POST /v1/chat/completions` bodies (OpenAI's chat API, text content, plus vLLM's common extras)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.gateway.api_common import (
    ChoiceCount, FinishReason, MaxTokens, MinP, MinTokens, ModelField, Penalty, RepetitionPenalty, Seed, Stop,
    StopTokenIds, StreamOptions, Temperature, TopK, TopP, UsageInfo,
)
from services.gateway.api_refused import RefusedChatFields
from services.gateway.api_tools import (
    ChatTool, DeltaToolCall, LogitBias, ResponseFormat, StructuredOutputs, ToolCall, ToolChoice,
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
    tool_calls: Annotated[list[ToolCall], Meta(max_length=128)] | None = None  # an assistant's calls
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None  # a tool message's answer to a call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(RefusedChatFields, kw_only=True, forbid_unknown_fields=True):  # type: ignore[misc,valid-type]
    """Every optional field takes `null` as unset."""

    model: ModelField
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=4096)]
    max_tokens: MaxTokens | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None  # default 1
    top_p: TopP | None = None  # default 1
    top_k: TopK | None = None
    min_p: MinP | None = None
    n: ChoiceCount | None = None  # default 1
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ChatTool], Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None  # default "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # false: at most one call
    user: Annotated[str, Meta(max_length=256)] | None = None  # accepted for OpenAI clients; not used
    safety_identifier: Annotated[str, Meta(max_length=256)] | None = None  # likewise
    # vLLM extras
    min_tokens: MinTokens | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # default true
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Meta(max_length=1 << 16)] | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1, max_length=1024)] | None = None
    guided_grammar: Annotated[str, Meta(max_length=1 << 16)] | None = None  # Lark
    structured_outputs: StructuredOutputs | None = None


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
    content: str | None = ""  # None when the answer is tool calls only
    tool_calls: list[ToolCall] | None = None


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
    tool_calls: list[DeltaToolCall] | None = None


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

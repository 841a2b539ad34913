"""`POST /v1/chat/completions`: messages rendered with the model's chat template, assistant text out."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody

from services.gateway.api_chat import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, LogprobEntry,
)
from services.gateway.api_common import UsageInfo
from services.gateway.api_refused import CHAT, refuse_unsupported
from services.gateway.api_tools import DeltaFunctionCall, DeltaToolCall, ToolCall
from services.gateway.edge import Receive, Scope
from services.gateway.errors import ApiError
from services.gateway.generation import Choice
from services.gateway.logprobs import chat_logprobs
from services.gateway.openapi import GenerationOperation, generation_responses
from services.gateway.guided import guided_of, sources_of
from services.gateway.prep import Knobs, chat_prompt, check_request, check_stream_options, logit_bias_of, or_default
from services.gateway.sse import event
from services.gateway.state import GatewayState
from services.gateway.streaming import ClientGone, Metering, collect, encoder, stream_response, usage_info
from services.gateway.submit import build_submits, new_id, start_generation
from services.gateway.tokenizers import Tokenizer, offload
from services.gateway.tool_calls import HOLD_PREFIXES, ToolMode, tool_mode
from shared.events.common import Guided
from shared.events.stream import TokenChunk

ROUTE = "/v1/chat/completions"
OBJECT_CHUNK = "chat.completion.chunk"


class ChatFormat:
    """Chunks of one chat request in OpenAI's `chat.completion.chunk` shape. With tools, a choice's
    text is held back while it may be a tool call (all of it when the call is forced), and a call
    found in it goes out as `tool_calls` deltas instead."""

    def __init__(self, response_id: str, created: int, model: str, tok: Tokenizer, logprobs: int | None,
                 choices: int, tools: ToolMode | None = None) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.tok = tok
        self.logprobs = logprobs
        self.choices = choices
        self.tools = tools if tools is not None and tools.parses else None
        self.held = [""] * choices
        self.holding = [self.tools is not None] * choices

    def _event(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return event(encoder.encode(ChatCompletionChunk(
            id=self.id, object=OBJECT_CHUNK, created=self.created, model=self.model, choices=choices, usage=usage)))

    def head(self) -> bytes:
        """The first delta of every choice carries the role, as OpenAI's stream does."""
        return b"".join(
            self._event([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                                         finish_reason=None)])
            for i in range(self.choices)
        )

    def logprobs_of(self, msg: TokenChunk) -> ChatLogprobs | None:
        if self.logprobs is None or msg.logprobs is None:
            return None
        return chat_logprobs(msg.logprobs, self.tok)

    def _visible(self, index: int, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """What of `text` the client sees now, and the tool calls found when the choice ends."""
        if not self.holding[index]:
            return text, []
        self.held[index] += text
        held = self.held[index]
        if final:
            self.holding[index] = False
            assert self.tools is not None
            content, calls = self.tools.parse(held)
            return content or "", calls
        start = held.lstrip()
        forced = self.tools is not None and self.tools.forced() is not None
        if forced or not start or any(start.startswith(p) or p.startswith(start) for p in HOLD_PREFIXES):
            return "", []
        self.holding[index] = False  # plain text after all: release it and stop looking
        return held, []

    def chunk(self, choice: Choice, msg: TokenChunk) -> bytes | None:
        if not msg.text and not msg.token_ids and msg.finish_reason is None:
            return None
        text, calls = self._visible(choice.index, msg.text, msg.finish_reason is not None)
        finish = msg.finish_reason
        if calls:
            finish = "tool_calls"
            delta = ChatDelta(content=text or None, tool_calls=[
                DeltaToolCall(index=k, id=c.id, type="function",
                              function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                for k, c in enumerate(calls)])
        else:
            delta = ChatDelta(content=text) if text else ChatDelta()
        return self._event([ChatChunkChoice(index=choice.index, delta=delta, logprobs=self.logprobs_of(msg),
                                            finish_reason=finish)])

    def usage_event(self, usage: UsageInfo) -> bytes:
        return self._event([], usage)


def knobs_of(data: ChatCompletionRequest, guided: Guided | None = None,
             logit_bias: tuple[tuple[int, float], ...] = ()) -> Knobs:
    if data.max_completion_tokens is not None:
        max_tokens, param = data.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = data.max_tokens, "max_tokens"
    logprobs = (data.top_logprobs or 0) if data.logprobs else None
    return Knobs(
        max_tokens=max_tokens, temperature=or_default(data.temperature, 1.0), top_p=or_default(data.top_p, 1.0),
        top_k=data.top_k, n=or_default(data.n, 1), stop=data.stop, seed=data.seed, logprobs=logprobs,
        min_tokens=or_default(data.min_tokens, 0), ignore_eos=bool(data.ignore_eos),
        stop_token_ids=data.stop_token_ids or [], max_tokens_param=param,
        presence_penalty=or_default(data.presence_penalty, 0.0), frequency_penalty=or_default(data.frequency_penalty, 0.0),
        repetition_penalty=or_default(data.repetition_penalty, 1.0), min_p=or_default(data.min_p, 0.0),
        logit_bias=logit_bias, guided=guided, include_stop_str_in_output=bool(data.include_stop_str_in_output),
        skip_special_tokens=or_default(data.skip_special_tokens, True),
    )


@post(ROUTE, status_code=200, operation_class=GenerationOperation,
      responses=generation_responses(ChatCompletionResponse), summary="Create a chat completion",
      description="OpenAI's chat completions API (text content); the prompt is rendered with the model's chat "
      "template. `stream: true` answers server-sent events (`data: {...}` chunks, then `data: [DONE]`).",
      tags=["generation"])
async def create_chat_completion(request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]) -> Response[bytes]:
    return await generate(request.app.state.gateway, request.scope, request.receive, data)


async def generate(state: GatewayState, scope: Scope, receive: Receive, data: ChatCompletionRequest) -> Response[bytes]:
    """The endpoint without Litestar: its handler, and the Edge's fast path for streams (`fast_path.py`)."""
    arrival = scope.get("tidal.arrival") or time.perf_counter()
    refuse_unsupported(data, CHAT)
    check_stream_options(data.stream, data.stream_options)
    tools = tool_mode(data)
    sources = sources_of(data)
    forced = tools.forced() if tools is not None else None
    if forced is not None:
        sources.append(("tool_choice", *forced))
    knobs = knobs_of(data, guided_of(sources))
    check_request(knobs, state.limits)
    if data.top_logprobs is not None and not data.logprobs:
        raise ApiError.bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    state.require_hub()
    target = state.resolve(data.model)
    tok = await state.tokenizers.get(target.model)
    if data.logit_bias:
        knobs = replace(knobs, logit_bias=logit_bias_of(data.logit_bias, tok.vocab_size))
    size = sum(len(m.content) if isinstance(m.content, str) else 0 for m in data.messages)
    prompt = await offload(size, chat_prompt, data.messages, tok, or_default(data.add_generation_prompt, True),
                           tools.template_tools() if tools is not None else None)
    base_id = new_id("chatcmpl")
    submits, groups = build_submits(state, target, [prompt], knobs, base_id=base_id, prompt_param="messages")
    gen = await start_generation(state, submits, groups, route=ROUTE, prompt_param="messages")
    fmt = ChatFormat(base_id, int(time.time()), data.model, tok, knobs.logprobs, len(submits), tools)
    meter = Metering(ROUTE, arrival, target.model.name)
    if data.stream:
        return stream_response(gen, fmt, meter, data.stream_options)

    texts: list[list[str]] = [[] for _ in submits]
    entries: list[list[LogprobEntry]] = [[] for _ in submits]
    finish: list[Any] = [None] * len(submits)

    def on_chunk(choice: Choice, msg: TokenChunk) -> None:
        texts[choice.index].append(msg.text)
        part = fmt.logprobs_of(msg)
        if part is not None and part.content:
            entries[choice.index].extend(part.content)
        if msg.finish_reason is not None:
            finish[choice.index] = msg.finish_reason

    try:
        await collect(gen, meter, receive, on_chunk)
    except ClientGone:
        return ApiError(499, "client closed the request", type="client_closed", code="client_closed").response()
    choices = []
    for i in range(len(submits)):
        content: str | None = "".join(texts[i])
        calls: list[ToolCall] = []
        if fmt.tools is not None:
            content, calls = fmt.tools.parse(content or "")
        choices.append(ChatChoice(
            index=i, message=AssistantMessage(content=content, tool_calls=calls or None),
            finish_reason="tool_calls" if calls else finish[i],
            logprobs=ChatLogprobs(content=entries[i]) if knobs.logprobs is not None else None))
    body = ChatCompletionResponse(id=base_id, created=fmt.created, model=data.model, usage=usage_info(gen),
                                  choices=choices)
    return Response(encoder.encode(body), media_type="application/json")


__all__ = ["ChatFormat", "create_chat_completion", "generate"]

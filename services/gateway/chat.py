"""`POST /v1/chat/completions`: messages rendered with the model's chat template, assistant text out."""
from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody

from services.gateway.api_chat import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, LogprobEntry,
)
from services.gateway.api_common import UsageInfo
from services.gateway.edge import Receive, Scope
from services.gateway.errors import ApiError
from services.gateway.generation import Choice
from services.gateway.logprobs import chat_logprobs
from services.gateway.openapi import GenerationOperation, generation_responses
from services.gateway.prep import Knobs, chat_prompt, check_request
from services.gateway.sse import event
from services.gateway.state import GatewayState
from services.gateway.streaming import ClientGone, Metering, collect, encoder, stream_response, usage_info
from services.gateway.submit import build_submits, new_id, start_generation
from services.gateway.tokenizers import Tokenizer, offload
from shared.events.stream import TokenChunk

ROUTE = "/v1/chat/completions"
OBJECT_CHUNK = "chat.completion.chunk"


class ChatFormat:
    """Chunks of one chat request in OpenAI's `chat.completion.chunk` shape."""

    def __init__(self, response_id: str, created: int, model: str, tok: Tokenizer, logprobs: int | None,
                 choices: int) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.tok = tok
        self.logprobs = logprobs
        self.choices = choices

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

    def chunk(self, choice: Choice, msg: TokenChunk) -> bytes | None:
        if not msg.text and not msg.token_ids and msg.finish_reason is None:
            return None
        delta = ChatDelta(content=msg.text) if msg.text else ChatDelta()
        return self._event([ChatChunkChoice(index=choice.index, delta=delta, logprobs=self.logprobs_of(msg),
                                            finish_reason=msg.finish_reason)])

    def usage_event(self, usage: UsageInfo) -> bytes:
        return self._event([], usage)


def knobs_of(data: ChatCompletionRequest) -> Knobs:
    if data.max_completion_tokens is not None:
        max_tokens, param = data.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = data.max_tokens, "max_tokens"
    logprobs = (data.top_logprobs or 0) if data.logprobs else None
    return Knobs(
        max_tokens=max_tokens, temperature=data.temperature, top_p=data.top_p, top_k=data.top_k, n=data.n,
        stop=data.stop, seed=data.seed, logprobs=logprobs, min_tokens=data.min_tokens, ignore_eos=data.ignore_eos,
        stop_token_ids=data.stop_token_ids, max_tokens_param=param,
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
    knobs = knobs_of(data)
    check_request(knobs, state.limits)
    if data.top_logprobs is not None and not data.logprobs:
        raise ApiError.bad_request("top_logprobs requires logprobs: true", param="top_logprobs")
    state.require_hub()
    target = state.resolve(data.model)
    tok = await state.tokenizers.get(target.model)
    size = sum(len(m.content) if isinstance(m.content, str) else 0 for m in data.messages)
    prompt = await offload(size, chat_prompt, data.messages, tok, data.add_generation_prompt)
    base_id = new_id("chatcmpl")
    submits, groups = build_submits(state, target, [prompt], knobs, base_id=base_id, prompt_param="messages")
    gen = await start_generation(state, submits, groups, route=ROUTE, prompt_param="messages")
    fmt = ChatFormat(base_id, int(time.time()), data.model, tok, knobs.logprobs, len(submits))
    meter = Metering(ROUTE, arrival)
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
    body = ChatCompletionResponse(
        id=base_id, created=fmt.created, model=data.model, usage=usage_info(gen),
        choices=[ChatChoice(index=i, message=AssistantMessage(content="".join(texts[i])), finish_reason=finish[i],
                            logprobs=ChatLogprobs(content=entries[i]) if knobs.logprobs is not None else None)
                 for i in range(len(submits))],
    )
    return Response(encoder.encode(body), media_type="application/json")


__all__ = ["ChatFormat", "create_chat_completion", "generate"]

"""`POST /v1/completions`: prompts in, text (streamed or whole) out."""
from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, post
from litestar.params import JSONBody

from services.gateway.api_common import UsageInfo
from services.gateway.api_completions import (
    CompletionChoice, CompletionChunk, CompletionChunkChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse,
)
from services.gateway.edge import Receive, Scope
from services.gateway.errors import ApiError
from services.gateway.generation import Choice
from services.gateway.logprobs import completion_logprobs, merge_completion
from services.gateway.openapi import GenerationOperation, generation_responses
from services.gateway.prep import Knobs, check_request, completion_prompts
from services.gateway.sse import event
from services.gateway.state import GatewayState
from services.gateway.streaming import ClientGone, Metering, collect, encoder, stream_response, usage_info
from services.gateway.submit import build_submits, new_id, start_generation
from services.gateway.tokenizers import Tokenizer, offload
from shared.events.stream import TokenChunk

ROUTE = "/v1/completions"


class CompletionFormat:
    """Chunks of one completions request in OpenAI's `text_completion` shape."""

    def __init__(self, response_id: str, created: int, model: str, tok: Tokenizer, logprobs: int | None,
                 echo: list[str] | None, groups: list[int]) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.tok = tok
        self.logprobs = logprobs
        self.echo = echo  # per prompt: its text, prepended to each of its choices
        self.groups = groups
        self.offsets = [0] * len(groups)  # characters sent per choice (logprobs text_offset)
        self.echoed = [False] * len(groups)

    def head(self) -> bytes:
        return b""

    def text_of(self, choice: Choice, msg: TokenChunk) -> str:
        text = msg.text
        if self.echo is not None and not self.echoed[choice.index]:
            self.echoed[choice.index] = True
            text = self.echo[self.groups[choice.index]] + text
        return text

    def logprobs_of(self, choice: Choice, msg: TokenChunk) -> CompletionLogprobs | None:
        if self.logprobs is None or msg.logprobs is None:
            return None
        return completion_logprobs(msg.logprobs, self.tok, self.offsets[choice.index], with_top=self.logprobs > 0)

    def chunk(self, choice: Choice, msg: TokenChunk) -> bytes | None:
        if not msg.text and not msg.token_ids and msg.finish_reason is None:
            return None
        logprobs = self.logprobs_of(choice, msg)
        text = self.text_of(choice, msg)
        self.offsets[choice.index] += len(text)
        return event(encoder.encode(CompletionChunk(
            id=self.id, object="text_completion", created=self.created, model=self.model,
            choices=[CompletionChunkChoice(index=choice.index, text=text, logprobs=logprobs,
                                           finish_reason=msg.finish_reason)],
        )))

    def usage_event(self, usage: UsageInfo) -> bytes:
        return event(encoder.encode(CompletionChunk(
            id=self.id, object="text_completion", created=self.created, model=self.model, choices=[], usage=usage)))


def knobs_of(data: CompletionRequest) -> Knobs:
    return Knobs(
        max_tokens=data.max_tokens, temperature=data.temperature, top_p=data.top_p, top_k=data.top_k, n=data.n,
        stop=data.stop, seed=data.seed, logprobs=data.logprobs, min_tokens=data.min_tokens,
        ignore_eos=data.ignore_eos, stop_token_ids=data.stop_token_ids,
    )


@post(ROUTE, status_code=200, operation_class=GenerationOperation, responses=generation_responses(CompletionResponse),
      summary="Create a completion", description="OpenAI's completions API; `stream: true` answers server-sent "
      "events (`data: {...}` chunks, then `data: [DONE]`).", tags=["generation"])
async def create_completion(request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]) -> Response[bytes]:
    return await generate(request.app.state.gateway, request.scope, request.receive, data)


async def generate(state: GatewayState, scope: Scope, receive: Receive, data: CompletionRequest) -> Response[bytes]:
    """The endpoint without Litestar: its handler, and the Edge's fast path for streams (`fast_path.py`)."""
    arrival = scope.get("tidal.arrival") or time.perf_counter()
    knobs = knobs_of(data)
    check_request(knobs, state.limits)
    if data.echo and data.logprobs is not None:
        raise ApiError.bad_request("echo together with logprobs is not supported", param="echo")
    state.require_hub()
    target = state.resolve(data.model)
    tok = await state.tokenizers.get(target.model)
    prompts = await offload(_text_size(data.prompt), completion_prompts, data.prompt, tok)
    base_id = new_id("cmpl")
    submits, groups = build_submits(state, target, prompts, knobs, base_id=base_id, prompt_param="prompt")
    echo = None
    if data.echo:
        echo = [p if isinstance(p, str) else tok.decode(ids) for p, ids in zip(_prompt_texts(data.prompt), prompts)]
    gen = await start_generation(state, submits, groups, route=ROUTE, prompt_param="prompt")
    fmt = CompletionFormat(base_id, int(time.time()), data.model, tok, data.logprobs, echo, groups)
    meter = Metering(ROUTE, arrival)
    if data.stream:
        return stream_response(gen, fmt, meter, data.stream_options)

    texts: list[list[str]] = [[] for _ in submits]
    logprobs: list[list[CompletionLogprobs]] = [[] for _ in submits]
    finish: list[Any] = [None] * len(submits)

    def on_chunk(choice: Choice, msg: TokenChunk) -> None:
        part = fmt.logprobs_of(choice, msg)
        text = fmt.text_of(choice, msg)
        fmt.offsets[choice.index] += len(text)
        texts[choice.index].append(text)
        if part is not None:
            logprobs[choice.index].append(part)
        if msg.finish_reason is not None:
            finish[choice.index] = msg.finish_reason

    try:
        await collect(gen, meter, receive, on_chunk)
    except ClientGone:
        return ApiError(499, "client closed the request", type="client_closed", code="client_closed").response()
    body = CompletionResponse(
        id=base_id, created=fmt.created, model=data.model, usage=usage_info(gen),
        choices=[CompletionChoice(index=i, text="".join(texts[i]), finish_reason=finish[i],
                                  logprobs=merge_completion(logprobs[i]) if data.logprobs is not None else None)
                 for i in range(len(submits))],
    )
    return Response(encoder.encode(body), media_type="application/json")


def _text_size(prompt: str | list[Any]) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def _prompt_texts(prompt: str | list[Any]) -> list[Any]:
    """Per prompt: its text, or None for a token-id prompt (decoded for echo)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [None]
    return list(prompt)


__all__ = ["CompletionFormat", "create_completion", "generate"]

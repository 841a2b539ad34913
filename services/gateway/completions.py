"""`POST /v1/completions`: prompts in, text (streamed or whole) out."""
from __future__ import annotations

import time
from dataclasses import replace
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
from services.gateway.api_refused import COMPLETION, refuse_unsupported
from services.gateway.guided import guided_of, sources_of
from services.gateway.prep import (
    Knobs, check_request, check_stream_options, completion_prompts, logit_bias_of, or_default,
)
from services.gateway.sse import event
from services.gateway.state import GatewayState
from services.gateway.streaming import ClientGone, Metering, collect, encoder, stream_response, usage_info
from services.gateway.submit import build_submits, new_id, start_generation
from services.gateway.tokenizers import Tokenizer, offload
from shared.events.common import Guided
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


def knobs_of(data: CompletionRequest, guided: Guided | None = None) -> Knobs:
    return Knobs(
        max_tokens=data.max_tokens, temperature=or_default(data.temperature, 1.0), top_p=or_default(data.top_p, 1.0),
        top_k=data.top_k, n=or_default(data.n, 1), stop=data.stop, seed=data.seed, logprobs=data.logprobs,
        min_tokens=or_default(data.min_tokens, 0), ignore_eos=bool(data.ignore_eos),
        stop_token_ids=data.stop_token_ids or [],
        presence_penalty=or_default(data.presence_penalty, 0.0), frequency_penalty=or_default(data.frequency_penalty, 0.0),
        repetition_penalty=or_default(data.repetition_penalty, 1.0), min_p=or_default(data.min_p, 0.0), guided=guided,
        include_stop_str_in_output=bool(data.include_stop_str_in_output),
        skip_special_tokens=or_default(data.skip_special_tokens, True),
    )


def best_of_knobs(data: CompletionRequest, knobs: Knobs) -> Knobs:
    """best_of > n: best_of samples per prompt, each with its chosen tokens' logprobs (to rank them)."""
    best_of = data.best_of
    if best_of is None or best_of == knobs.n:
        return knobs
    if best_of < knobs.n:
        raise ApiError.bad_request(f"best_of ({best_of}) must be at least n ({knobs.n})", param="best_of")
    if data.stream:
        raise ApiError.bad_request("best_of greater than n cannot be streamed", param="best_of")
    return replace(knobs, n=best_of, logprobs=knobs.logprobs if knobs.logprobs is not None else 0)


def best_choices(n: int, groups: list[int], scores: list[float]) -> list[int]:
    """Of each prompt's samples, the `n` with the highest cumulative logprob, in OpenAI's choice order."""
    keep: list[int] = []
    for group in sorted(set(groups)):
        mine = [i for i, g in enumerate(groups) if g == group]
        keep += sorted(sorted(mine, key=lambda i: -scores[i])[:n])
    return keep


@post(ROUTE, status_code=200, operation_class=GenerationOperation, responses=generation_responses(CompletionResponse),
      summary="Create a completion", description="OpenAI's completions API; `stream: true` answers server-sent "
      "events (`data: {...}` chunks, then `data: [DONE]`).", tags=["generation"])
async def create_completion(request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]) -> Response[bytes]:
    return await generate(request.app.state.gateway, request.scope, request.receive, data)


async def generate(state: GatewayState, scope: Scope, receive: Receive, data: CompletionRequest) -> Response[bytes]:
    """The endpoint without Litestar: its handler, and the Edge's fast path for streams (`fast_path.py`)."""
    arrival = scope.get("tidal.arrival") or time.perf_counter()
    refuse_unsupported(data, COMPLETION)
    check_stream_options(data.stream, data.stream_options)
    knobs = best_of_knobs(data, knobs_of(data, guided_of(sources_of(data))))
    check_request(knobs, state.limits)  # best_of > n: its samples count against max_n
    if data.echo and data.logprobs is not None:
        raise ApiError.bad_request("echo together with logprobs is not supported", param="echo")
    state.require_hub()
    target = state.resolve(data.model)
    tok = await state.tokenizers.get(target.model)
    if data.logit_bias:
        knobs = replace(knobs, logit_bias=logit_bias_of(data.logit_bias, tok.vocab_size))
    prompts = await offload(_text_size(data.prompt), completion_prompts, data.prompt, tok)
    base_id = new_id("cmpl")
    submits, groups = build_submits(state, target, prompts, knobs, base_id=base_id, prompt_param="prompt")
    echo = None
    if data.echo:
        echo = [p if isinstance(p, str) else tok.decode(ids) for p, ids in zip(_prompt_texts(data.prompt), prompts)]
    gen = await start_generation(state, submits, groups, route=ROUTE, prompt_param="prompt")
    fmt = CompletionFormat(base_id, int(time.time()), data.model, tok, data.logprobs, echo, groups)
    meter = Metering(ROUTE, arrival, target.model.name)
    if data.stream:
        return stream_response(gen, fmt, meter, data.stream_options)

    texts: list[list[str]] = [[] for _ in submits]
    logprobs: list[list[CompletionLogprobs]] = [[] for _ in submits]
    finish: list[Any] = [None] * len(submits)
    scores = [0.0] * len(submits)  # cumulative logprob of each sample (best_of)

    def on_chunk(choice: Choice, msg: TokenChunk) -> None:
        part = fmt.logprobs_of(choice, msg)
        text = fmt.text_of(choice, msg)
        fmt.offsets[choice.index] += len(text)
        texts[choice.index].append(text)
        scores[choice.index] += sum(lp.logprob for lp in msg.logprobs or ())
        if part is not None:
            logprobs[choice.index].append(part)
        if msg.finish_reason is not None:
            finish[choice.index] = msg.finish_reason

    try:
        await collect(gen, meter, receive, on_chunk)
    except ClientGone:
        return ApiError(499, "client closed the request", type="client_closed", code="client_closed").response()
    keep = best_choices(or_default(data.n, 1), groups, scores) if knobs.n != or_default(data.n, 1) else \
        list(range(len(submits)))
    body = CompletionResponse(
        id=base_id, created=fmt.created, model=data.model, usage=usage_info(gen),
        choices=[CompletionChoice(index=k, text="".join(texts[i]), finish_reason=finish[i],
                                  logprobs=merge_completion(logprobs[i]) if data.logprobs is not None else None)
                 for k, i in enumerate(keep)],
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

"""vLLM's utility routes: `POST /tokenize`, `POST /detokenize` and `GET /version`.

    POST /tokenize   {"model", "prompt"} or {"model", "messages"[, "tools"]}  -> {"count", "max_model_len", "tokens"}
    POST /detokenize {"model", "tokens"}                                      -> {"prompt"}

A chat is rendered with the model's chat template exactly as /v1/chat/completions renders it,
so `count` is the prompt_tokens a completion of it reports.
"""
from __future__ import annotations

from importlib import metadata
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi import ResponseSpec
from litestar.params import JSONBody
from msgspec import Meta

from services.gateway.api_chat import ChatMessage
from services.gateway.api_common import ModelField, TokenIdField
from services.gateway.api_tools import ChatTool
from services.gateway.errors import ApiError
from services.gateway.openapi import ApiOperation, errors
from services.gateway.prep import chat_prompt, or_default
from services.gateway.state import GatewayState
from services.gateway.streaming import encoder
from services.gateway.tokenizers import offload
from services.gateway.tool_calls import ToolMode

_JSON = "application/json"


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of `prompt` (text) and `messages` (a chat, rendered with the model's template)."""

    model: ModelField
    prompt: Annotated[str, Meta(max_length=1 << 20)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=4096)] | None = None
    tools: Annotated[list[ChatTool], Meta(max_length=128)] | None = None
    add_special_tokens: bool | None = None  # text: default true (BOS); a chat's template writes its own
    add_generation_prompt: bool | None = None  # chat: default true
    return_token_strs: bool | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ModelField
    tokens: Annotated[list[TokenIdField], Meta(max_length=1 << 20)]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str


def _state(request: Request[Any, Any, Any]) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


@post("/tokenize", status_code=200, summary="Tokenize a prompt or a chat (vLLM's API)", tags=["utilities"],
      operation_class=ApiOperation, responses={200: ResponseSpec(TokenizeResponse, description="The token ids",
                                                                 generate_examples=False), **errors(400, 401, 404, 413, 415, 503)})
async def tokenize(request: Request[Any, Any, Any], data: JSONBody[TokenizeRequest]) -> Response[bytes]:
    if (data.prompt is None) == (data.messages is None):
        raise ApiError.bad_request("give exactly one of prompt and messages", param="prompt")
    state = _state(request)
    target = state.resolve(data.model)
    tok = await state.tokenizers.get(target.model)
    if data.messages is not None:
        tools = ToolMode("none", data.tools).template_tools() if data.tools else None
        size = sum(len(m.content) if isinstance(m.content, str) else 0 for m in data.messages)
        ids = await offload(size, chat_prompt, data.messages, tok, or_default(data.add_generation_prompt, True), tools)
    else:
        assert data.prompt is not None
        special = or_default(data.add_special_tokens, True)
        ids = await offload(len(data.prompt), tok.engine.encode, data.prompt, special)
    strs = [tok.piece(i) for i in ids] if data.return_token_strs else None
    body = TokenizeResponse(count=len(ids), max_model_len=target.model.max_context, tokens=ids, token_strs=strs)
    return Response(encoder.encode(body), media_type=_JSON)


@post("/detokenize", status_code=200, summary="Detokenize token ids (vLLM's API)", tags=["utilities"],
      operation_class=ApiOperation, responses={200: ResponseSpec(DetokenizeResponse, description="The text",
                                                                 generate_examples=False), **errors(400, 401, 404, 413, 415, 503)})
async def detokenize(request: Request[Any, Any, Any], data: JSONBody[DetokenizeRequest]) -> Response[bytes]:
    state = _state(request)
    target = state.resolve(data.model)
    tok = await state.tokenizers.get(target.model)
    bad = next((t for t in data.tokens if t >= tok.vocab_size), None)
    if bad is not None:
        raise ApiError.bad_request(f"token id {bad} is outside the vocabulary (size {tok.vocab_size})", param="tokens")
    text = await offload(len(data.tokens), tok.decode, data.tokens)
    return Response(encoder.encode(DetokenizeResponse(prompt=text)), media_type=_JSON)


@get("/version", summary="The server's version", tags=["utilities"], responses={
    200: ResponseSpec(VersionResponse, description="This gateway's package version", generate_examples=False)})
async def version() -> Response[bytes]:
    try:
        found = metadata.version("tidal-serve")
    except metadata.PackageNotFoundError:
        found = "0+unknown"
    return Response(encoder.encode(VersionResponse(version=found)), media_type=_JSON)


__all__ = ["DetokenizeRequest", "TokenizeRequest", "detokenize", "tokenize", "version"]

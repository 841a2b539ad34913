"""Streaming generation requests straight to their endpoint, past Litestar (an ASGI layer behind the Edge).

The time to first token is the serving path's figure of merit, and for one request Litestar's
routing, parameter injection and body validation cost about 0.2 ms of the gateway's CPU on
this path (traced in docs/benchmarks.md#gateway). So a `POST` to a generation route whose
body decodes (strictly) as that route's request with `stream: true` is handed to the
endpoint's `generate` here, and its `EventStream` answers; anything else — a body that does
not decode, a non-streaming request, every other route — goes to Litestar unchanged, so
validation errors, the OpenAPI document and the non-streaming answers are Litestar's as
before. The Edge in front has already authenticated, rate-limited and read the body.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from litestar import Response

from services.gateway import chat, completions
from services.gateway.api_chat import ChatCompletionRequest
from services.gateway.api_completions import CompletionRequest
from services.gateway.edge import ASGIApp, Message, Receive, Scope, Send, send_error
from services.gateway.errors import ApiError
from services.gateway.sse import EventStreamResponse
from services.gateway.state import GatewayState

Endpoint = Callable[[GatewayState, Scope, Receive, Any], Awaitable[Response[bytes]]]

ROUTES: dict[str, tuple[msgspec.json.Decoder[Any], Endpoint]] = {
    completions.ROUTE: (msgspec.json.Decoder(CompletionRequest), completions.generate),
    chat.ROUTE: (msgspec.json.Decoder(ChatCompletionRequest), chat.generate),
}


def _replaying(first: Message, receive: Receive) -> Receive:
    pending = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


class FastPath:
    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        first = await receive()  # the whole body: the Edge read it
        data = None
        if first["type"] == "http.request" and not first.get("more_body", False):
            try:
                data = route[0].decode(first.get("body", b""))
            except msgspec.MsgspecError:
                pass  # Litestar's validation names what is wrong
        if data is None or not data.stream:
            await self.app(scope, _replaying(first, receive), send)
            return
        try:
            response = await route[1](self.state, scope, receive, data)
        except ApiError as error:
            await send_error(send, error)
            return
        if isinstance(response, EventStreamResponse):
            await response.stream(scope, receive, send)
        else:  # a streaming request is always answered with a stream; anything else is a bug
            await send_error(send, ApiError.internal())


__all__ = ["FastPath", "ROUTES"]

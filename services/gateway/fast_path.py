"""Streaming generation requests straight to their endpoint, past Litestar (an ASGI layer behind the Edge).

The time to first token is the serving path's figure of merit, and for one request Litestar's
routing, parameter injection and body validation cost about 0.2 ms of the gateway's CPU on
this path (traced in docs/benchmarks.md#gateway). So a `POST` to a generation route whose
body decodes (strictly) as that route's request with `stream: true` is handed to the
endpoint's `generate` here, and its `EventStream` answers.

Every `POST` with a JSON body is checked here first (`body_guard.py`): a body that is not JSON,
not UTF-8, nested past what msgspec decodes, of another content type or not of the route's
type is answered 4xx here, so Litestar only ever decodes bodies known to decode. The rest — a
non-streaming request, every other route — goes to Litestar unchanged. The Edge in front has
already authenticated, rate-limited and read the body.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Response

from services.gateway import chat, completions
from services.gateway.api_adapters import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from services.gateway.api_chat import ChatCompletionRequest
from services.gateway.api_completions import CompletionRequest
from services.gateway.body_guard import BodyGuard
from services.gateway.routes_tokenize import DetokenizeRequest, TokenizeRequest
from services.gateway.edge import ASGIApp, Message, Receive, Scope, Send, send_error
from services.gateway.errors import ApiError
from services.gateway.sse import EventStreamResponse
from services.gateway.state import GatewayState

Endpoint = Callable[[GatewayState, Scope, Receive, Any], Awaitable[Response[bytes]]]

# route -> its body's guard, and the endpoint that streams without Litestar (None: never streams)
ROUTES: dict[str, tuple[BodyGuard, Endpoint | None]] = {
    completions.ROUTE: (BodyGuard.for_type(CompletionRequest), completions.generate),
    chat.ROUTE: (BodyGuard.for_type(ChatCompletionRequest), chat.generate),
    "/v1/load_lora_adapter": (BodyGuard.for_type(LoadLoraAdapterRequest), None),
    "/v1/unload_lora_adapter": (BodyGuard.for_type(UnloadLoraAdapterRequest), None),
    "/tokenize": (BodyGuard.for_type(TokenizeRequest), None),
    "/detokenize": (BodyGuard.for_type(DetokenizeRequest), None),
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
        if first["type"] != "http.request" or first.get("more_body", False):
            await self.app(scope, _replaying(first, receive), send)  # the client left: Litestar sees it
            return
        body = first.get("body", b"")
        checked = route[0].check(scope["headers"], body)
        if isinstance(checked, ApiError):
            await send_error(send, checked)
            return
        data, strict = checked
        endpoint = route[1]
        if endpoint is None or not strict or not data.stream:
            await self.app(scope, _replaying(first, receive), send)
            return
        try:
            response = await endpoint(self.state, scope, receive, data)
        except ApiError as error:
            await send_error(send, error)
            return
        if isinstance(response, EventStreamResponse):
            await response.stream(scope, receive, send)
        else:  # a streaming request is always answered with a stream; anything else is a bug
            await send_error(send, ApiError.internal())


__all__ = ["FastPath", "ROUTES"]

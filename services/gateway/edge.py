"""The gateway's front door: a raw ASGI middleware that runs before Litestar routes anything.

In order, on the raw path: count and time the request (Prometheus), check the API key
(401; `/health` and `/ready` are exempt), refuse `/v1/` work while draining (503), apply the
key's rate limit (429), and read the body up to the configured limit (413 as soon as the
declared or received size passes it — nothing beyond the limit is buffered). Anything that
escapes the app becomes a generic 500 in the OpenAI shape, the traceback only in the log.
"""
from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

from services.gateway.errors import ApiError, log_failure
from services.gateway.metrics import HTTP_REQUESTS, HTTP_SECONDS, route_label
from services.gateway.state import GatewayState

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health", "/ready"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class TooLarge(Exception):
    pass


async def send_error(send: Send, error: ApiError) -> None:
    body = error.encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [*error.raw_headers(), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


async def read_body(receive: Receive, limit: int) -> Receive:
    """Read the whole body (at most `limit` bytes, else TooLarge); returns a `receive` that replays it."""
    parts: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left while sending: let the app see it
            first = message
            break
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            raise TooLarge()
        parts.append(chunk)
        if not message.get("more_body", False):
            first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
            break
    pending: list[Message] = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


class Edge:
    def __init__(self, app: ASGIApp, state: GatewayState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        scope["tidal.arrival"] = started
        path: str = scope["path"]
        status = 0

        async def send_tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self.admit(scope, path)
            if error is None and scope["method"] in BODY_METHODS:
                try:
                    receive = await read_body(receive, self._declared_ok(scope))
                except TooLarge:
                    error = ApiError.too_large(self.state.max_body_bytes)
            if error is not None:
                await send_error(send_tracked, error)
            else:
                await self.app(scope, receive, send_tracked)
        except Exception as exc:
            log_failure("request failed outside the handlers", exc, path=path[:256])
            if status == 0:
                await send_error(send_tracked, ApiError.internal())
        finally:
            route = route_label(path)
            HTTP_REQUESTS.labels(route, str(status or 500)).inc()
            HTTP_SECONDS.labels(route).observe(time.perf_counter() - started)

    def _declared_ok(self, scope: Scope) -> int:
        """The body limit; TooLarge at once when Content-Length already says more."""
        limit = self.state.max_body_bytes
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise TooLarge()
        return limit

    def admit(self, scope: Scope, path: str) -> ApiError | None:
        state = self.state
        if path in PUBLIC_PATHS:
            return None
        authorization = header(scope, b"authorization")
        key_id: str | None = None
        if state.api_keys.required:
            key_id = state.api_keys.check(authorization)
            if key_id is None:
                text = "Missing API key" if authorization is None else "Incorrect API key provided"
                return ApiError.unauthorized(f"{text}: send 'Authorization: Bearer <key>'.")
        if not path.startswith("/v1/"):
            return None
        if state.draining:
            return ApiError.unavailable("draining", "The gateway is shutting down; retry the request.", 1.0)
        if state.rate_limiter.enabled:
            key = key_id or state.api_keys.key_id(authorization) or _client_host(scope)
            wait = state.rate_limiter.take(key, time.monotonic())
            if wait > 0:
                return ApiError.rate_limited(wait)
        return None


def _client_host(scope: Scope) -> str:
    client = scope.get("client")
    return f"ip:{client[0]}" if client else "anonymous"


__all__ = ["Edge", "PUBLIC_PATHS", "read_body", "send_error"]

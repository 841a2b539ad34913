"""An OpenTelemetry SERVER span around every HTTP request (outermost ASGI layer).

With tracing on (`--tracing`/`TIDAL_TRACING`, the gateway bus's `Tracing`), each request gets a
span named `<METHOD> <route>` (route: the API path, or none for an unknown one) with its status
code and, for generations, `tidal.request_id`; it is the current span while the request is
handled, so the NATS spans of its submit, chunks and aborts, and through their headers the
dispatcher's and worker's spans, are its descendants. A client's `traceparent` is its parent.
With tracing off this layer costs one attribute lookup per request.
"""
from __future__ import annotations

from collections.abc import Callable

from services.gateway.edge import ASGIApp, Message, Receive, Scope, Send
from services.gateway.metrics import ROUTES
from shared.tracing import Tracing, end_http_span, http_server_span

_TRACE_HEADERS = (b"traceparent", b"tracestate")


class HttpSpans:
    def __init__(self, app: ASGIApp, tracing: Callable[[], Tracing | None]) -> None:
        self.app = app
        self.tracing = tracing  # looked up per request: the bus (and so its Tracing) comes after the app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing = self.tracing() if scope["type"] == "http" else None
        if tracing is None:
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path: str = scope["path"]
        carried = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS}
        with http_server_span(tracing, scope["method"], path if path in ROUTES else None, path, carried) as span:
            try:
                await self.app(scope, receive, send_tracked)
            finally:
                end_http_span(span, status or 500)


__all__ = ["HttpSpans"]

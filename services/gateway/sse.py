"""Server-sent events over ASGI, with client-disconnect detection.

`EventStream` sends each bytes object its iterator yields as one body part (`data: ...\\n\\n`
events, already encoded) and watches `receive()` meanwhile: the moment the server reports
`http.disconnect`, `on_disconnect` runs (the generation publishes its aborts) — the stream
does not wait for the next token to notice that nobody listens.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from litestar import Response
from litestar.response.base import ASGIResponse

DONE = b"data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


async def wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]], on_disconnect: Callable[[], Awaitable[None]]) -> None:
    """Until the client goes away (then call `on_disconnect`); cancelled when the response ends."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            await on_disconnect()
            return


class EventStream(ASGIResponse):
    __slots__ = ("events", "on_disconnect", "on_end", "gone")
    _should_set_content_length = False

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], Awaitable[None]],
                 on_end: Callable[[], Awaitable[None]]) -> None:
        super().__init__(status_code=200, media_type="text/event-stream", headers=HEADERS)
        self.events = events
        self.on_disconnect = on_disconnect
        self.on_end = on_end  # runs however the stream ends (an unstarted generator has no finally)
        self.gone = False

    async def _disconnected(self) -> None:
        self.gone = True
        await self.on_disconnect()

    async def send_body(self, send: Any, receive: Any) -> None:
        watcher = asyncio.ensure_future(wait_disconnect(receive, self._disconnected))
        try:
            async for data in self.events:
                if self.gone:
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if not self.gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.events.aclose()  # type: ignore[attr-defined]  # an async generator
            await self.on_end()


class EventStreamResponse(Response[bytes]):
    """What a handler returns: Litestar turns it into the `EventStream` ASGI response."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__(b"", status_code=200, media_type="text/event-stream")
        self.stream = stream

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIResponse:  # type: ignore[override]
        return self.stream


def event_stream(events: AsyncIterator[bytes], on_disconnect: Callable[[], Awaitable[None]],
                 on_end: Callable[[], Awaitable[None]]) -> EventStreamResponse:
    return EventStreamResponse(EventStream(events, on_disconnect, on_end))


__all__ = ["DONE", "EventStream", "EventStreamResponse", "event", "event_stream", "wait_disconnect"]

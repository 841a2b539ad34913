"""Replies to in-flight requests, routed over one wildcard inbox subscription per connection.

nats-py's `request()` does the same job, but per request it draws random bytes from the OS
(a syscall), wraps the wait in `asyncio.wait_for` (an extra future, a partial and two
callbacks) and builds the inbox with bytearray copies. On the request path that is a
measurable share of a loopback round trip, so the bus keeps its own: a counter token, one
future and one timer handle per request. Built only on public nats-py calls (`new_inbox`,
`subscribe`, `publish`); after a reconnect nats-py re-subscribes the inbox like any other.
"""
from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg

NO_RESPONDERS_STATUS = "503"  # what the server sends to the reply inbox when nobody is subscribed


class ReplyTimeout(Exception):
    """No reply before the timer fired."""


class NoRespondersStatus(Exception):
    """The server reported that nobody listens on the subject."""


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(ReplyTimeout())


class ReplyMux:
    """Send requests and match their replies by token. `start()` once, after connecting."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = ""
        self.pending: dict[str, asyncio.Future[Msg]] = {}
        self._next = 0
        self._prefix_len = 0

    async def start(self) -> None:
        self.prefix = self.nc.new_inbox() + "."
        self._prefix_len = len(self.prefix)
        await self.nc.subscribe(self.prefix + "*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        future = self.pending.pop(msg.subject[self._prefix_len:], None)
        if future is not None and not future.done():
            future.set_result(msg)

    async def request(self, subject: str, payload: bytes, timeout: float, headers: dict[str, str] | None) -> Msg:
        """Publish with a reply inbox and wait at most `timeout` seconds for the reply.

        Raises ReplyTimeout or NoRespondersStatus; cancellation cleans up like a timeout.
        """
        self._next += 1
        token = format(self._next, "x")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self.pending[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            await self.nc.publish(subject, payload, reply=self.prefix + token, headers=headers)
            msg = await future
        finally:
            timer.cancel()
            self.pending.pop(token, None)
        if msg.headers is not None and not msg.data and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
            raise NoRespondersStatus()
        return msg

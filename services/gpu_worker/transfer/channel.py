"""The UCX endpoint as the data plane uses it: post a tagged send or receive, get a future.

The one place that touches ucxx below its public coroutine API. `Endpoint.send/recv` cost a
task, a SHA-1 of the tag (ucxx hashes the user tag with the endpoint's own tag on every
call) and a buffer wrapper per message; at several messages per chunk that was a large share
of the per-chunk cost on a 2-core machine. Here the per-endpoint tags are hashed once, and a
post returns the request's own asyncio future (ucxx runs with Python futures: its notifier
thread completes them; see plane.acquire_ucx).

Tags stay endpoint-specific (UCX matches tags per worker, not per endpoint), exactly as
ucxx's own send/recv would compute them.
"""
from __future__ import annotations

import asyncio
from typing import Any

from ucxx._lib.arr import Array
from ucxx._lib_async.utils import hash64bits
from ucxx.types import Tag, TagMaskFull

from .frames import TAG_DATA, TAG_FRAME, TAG_INLINE, TAG_REPLY

_TAGS = (TAG_FRAME, TAG_REPLY, TAG_INLINE)


class Channel:
    """Tagged messages on one ucxx endpoint (either side of the connection)."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self._ep = endpoint._ep
        tags = endpoint._tags
        self._send_tag = {t: Tag(hash64bits(tags["msg_send"], hash(t))) for t in _TAGS}
        self._recv_tag = {t: Tag(hash64bits(tags["msg_recv"], hash(t))) for t in _TAGS}

    def data_tags(self, transfer_id: int) -> tuple[Any, Any]:
        """(send tag, receive tag) of one transfer's payloads on this endpoint."""
        key = hash((TAG_DATA, transfer_id))
        tags = self.endpoint._tags
        return Tag(hash64bits(tags["msg_send"], key)), Tag(hash64bits(tags["msg_recv"], key))

    def send_tagged(self, buffer: Any, tag: Any) -> "asyncio.Future[Any]":
        self._ep.raise_on_error()
        return _checked(self._ep.tag_send(Array(buffer), tag), buffer)

    def recv_tagged(self, buffer: Any, tag: Any) -> "asyncio.Future[Any]":
        self._ep.raise_on_error()
        return _checked(self._ep.tag_recv(Array(buffer), tag, TagMaskFull), buffer)

    def send(self, buffer: Any, tag: int) -> "asyncio.Future[Any]":
        """Post `buffer` (host array or CUDA tensor); the future completes once UCX is done with it.

        The buffer must stay alive and unchanged until then (the caller keeps a reference)."""
        self._ep.raise_on_error()
        return _checked(self._ep.tag_send(Array(buffer), self._send_tag[tag]), buffer)

    def recv(self, buffer: Any, tag: int) -> "asyncio.Future[Any]":
        """Post a receive straight into `buffer` (a message larger than it fails: truncated)."""
        self._ep.raise_on_error()
        return _checked(self._ep.tag_recv(Array(buffer), self._recv_tag[tag], TagMaskFull), buffer)

    def abort(self) -> None:
        self.endpoint.abort()

    async def close(self) -> None:
        await self.endpoint.close()


def _checked(request: Any, buffer: Any) -> "asyncio.Future[Any]":
    """The request's future, failing with the request's UCX error (not just 'done').

    The closure keeps `request` and `buffer` alive until UCX is done with the memory."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def done(f: "asyncio.Future[Any]", _keep: Any = (request, buffer)) -> None:
        if not f.cancelled():
            f.exception()  # retrieved here even when nobody waits any more (cancelled at close)
        if fut.done():
            return
        try:
            if f.cancelled():
                raise asyncio.CancelledError()
            f.result()
            request.check_error()
        except BaseException as exc:  # noqa: BLE001 - hand every UCX failure to the waiter
            fut.set_exception(exc)
        else:
            fut.set_result(None)

    source = request.future
    if source is None:  # completed inline, before a future was attached
        request.check_error()
        fut.set_result(None)
    else:
        source.add_done_callback(done)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # errors are read by whoever awaits
    return fut

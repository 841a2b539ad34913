"""Defence in depth: a generation that makes no progress for `stream_stall_timeout` ends with an error.

Every stream should end on its own — its last chunk, or a `StreamError` from the dispatcher or a
worker — however its workers fail (re-dispatch, buddy-group collapse, migration). Should a bug
anywhere in that chain lose a request, its client would otherwise wait until `request_timeout`
(10 minutes by default) with no byte and no `[DONE]`. `progress_guarded` wraps
`Generation.batches()`: progress is any message of the request (a token chunk, a re-dispatch's
fence, an error); when none has come for `stall_s` the generation is abandoned (its sequences are
aborted on the workers) and `StreamStalled` is raised, which the caller turns into an in-stream
error event and `[DONE]`, or the HTTP status of a non-streamed answer (503 `stream_stalled`).

The stall time counts from the submit, so it must exceed the longest a request may wait in a
queue for capacity (a cold model's start included): the queue's own timeouts answer those first.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

from services.gateway.errors import ApiError
from services.gateway.generation import Generation
from services.gateway.metrics import STREAM_ANOMALIES
from shared.logging import get_logger

log = get_logger("tidal.gateway.stream_guard")
_STALLED = STREAM_ANOMALIES.labels("stalled")
T = TypeVar("T")


class StreamStalled(Exception):
    def __init__(self, stall_s: float) -> None:
        super().__init__(f"no progress for {stall_s:g} s")
        self.error = ApiError.unavailable(
            "stream_stalled", f"The request made no progress for {stall_s:g} s (the gateway's "
            "stream_stall_timeout) and was ended; tokens already sent are valid. Retry the request.", 1.0)


async def progress_guarded(gen: Generation, batches: AsyncIterator[list[T]], stall_s: float) -> AsyncIterator[list[T]]:
    """`batches` as they come; raises StreamStalled (the generation abandoned) after `stall_s` with no
    message. `stall_s` <= 0: unguarded."""
    if stall_s <= 0:
        async for batch in batches:
            yield batch
        return
    last = time.monotonic()
    while True:
        left = last + stall_s - time.monotonic()
        try:
            batch = await asyncio.wait_for(batches.__anext__(), max(left, 0.0))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            _STALLED.inc()
            log.warning("stream made no progress: ended with an error", stall_s=stall_s,
                        requests=[c.request_id for c in gen.choices if not c.done])
            await gen.abandon("cancelled")
            raise StreamStalled(stall_s) from None
        if batch:  # (an empty batch: a gap given up on, no message of the request)
            last = time.monotonic()
        yield batch


__all__ = ["StreamStalled", "progress_guarded"]

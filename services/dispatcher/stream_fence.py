"""What the dispatcher tells the bus about a request's stream when its owner changes (the assignment fence).

A re-dispatch publishes `StreamReassigned` before the new attempt's Assignment (from `next_seq` on, the
stream belongs to the new attempt); a worker we gave up on that is still generating is told, once, to
stop its copy (a targeted abort); a request that cannot go on ends with one `StreamError`. Pure: each
function builds the effect from the request's state and marks what it told.
See docs/serving.md "Streams fenced by assignment".
"""
from __future__ import annotations

from shared.events import AbortRequest, StreamError, StreamReassigned, Usage

from services.dispatcher.effects import Effect, PublishAbort, PublishFence, PublishStreamError
from services.dispatcher.tracked import TrackedRequest


def stream_error(req: TrackedRequest, code: str, message: str) -> PublishStreamError:
    """End `req`'s stream at its next seq, with the tokens it produced so far as usage."""
    return PublishStreamError(StreamError(
        request_id=req.request_id, seq=req.next_seq, code=code, message=message,
        usage=Usage(prompt_tokens=len(req.submit.prompt_token_ids), completion_tokens=len(req.emitted)),
    ))


def fence(req: TrackedRequest, lost_worker: str) -> PublishFence:
    """The new attempt owns the stream from `next_seq` on; the lost worker's messages are stale."""
    return PublishFence(StreamReassigned(request_id=req.request_id, attempt=req.attempt, from_seq=req.next_seq,
                                         worker_id=lost_worker or None))


def stop_stale_copy(req: TrackedRequest, worker: str, now: float) -> list[Effect]:
    """A worker we gave up on is still generating `req` (cut off, paused, or slow to hear of its loss):
    tell it, once, to stop that copy. Consumers drop its messages meanwhile (the fence)."""
    if worker in req.told_to_stop:
        return []
    req.told_to_stop.add(worker)
    return [PublishAbort(AbortRequest(request_id=req.request_id, reason="superseded", ts=now, worker_id=worker,
                                      attempt=req.attempt))]

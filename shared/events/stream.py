"""Family `stream`: a request's tokens on `tidal.v1.req.<request_id>.out` and its abort.

A worker publishes `TokenChunk`s numbered `seq` = 0, 1, 2, ... with no gap, across
re-dispatches and migrations (the next owner continues the numbering). The last message of
a stream is either a `TokenChunk` with `finish_reason` and `usage` set, or a `StreamError`.
A consumer drops a chunk whose `seq` it has already seen (at-least-once is safe) and
treats a gap as lost messages.

Streams are fenced by assignment: every worker message carries the `attempt` (the
dispatcher's re-dispatch count) and `handover` (live migrations within that attempt) of
the assignment that produced it, and `(attempt, handover)` only grows. A re-dispatch is
announced on the stream by `StreamReassigned` (attempt, `from_seq`) before the new worker
is told; a migration's first chunk on its destination announces itself. From then on a
message of an older assignment at or past that seq is stale (a worker that was cut off,
paused or gave the request away) and a consumer drops it, so a zombie never adds a byte.
The fence in code: services/gateway/seq_order.py.
"""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    MAX_CHUNK_TOKENS, Attempt, Handover, Message, Reason, RequestId, Seq, Text, Timestamp, TokenId, WorkerId,
)
from shared.events.common import TokenLogprobs, Usage

FinishReason = Literal[
    "stop",  # EOS, a stop token id or a stop string
    "length",  # max_tokens reached
    "abort",  # aborted (client went away, cancelled or past its deadline)
]


class TokenChunk(Message, kw_only=True):
    """Tokens generated since the previous chunk, and their text (never a split UTF-8 character)."""

    request_id: RequestId
    seq: Seq
    token_ids: Annotated[list[TokenId], Meta(max_length=MAX_CHUNK_TOKENS)] = []
    text: Text = ""
    logprobs: Annotated[list[TokenLogprobs], Meta(max_length=MAX_CHUNK_TOKENS)] | None = None
    finish_reason: FinishReason | None = None  # set on the final chunk only
    usage: Usage | None = None  # set on the final chunk only
    worker_id: WorkerId | None = None  # who generated it (the dispatcher learns migrations from this)
    attempt: Attempt = 0  # the assignment that generated it (see the module doc: the fence)
    handover: Handover = 0

    def __post_init__(self) -> None:
        if (self.finish_reason is None) != (self.usage is None):
            raise ValueError("finish_reason and usage must both be set (final chunk) or both be absent")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {len(self.token_ids)} tokens")

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


StreamErrorCode = Literal[
    "redispatch_limit",  # its workers died more often than dispatcher.max_redispatches
    "worker_lost",  # a stale worker's chunks reached the client before the re-dispatch's fence: not resumable
    "queue_timeout",  # admitted but never scheduled before its deadline
    "internal",  # a bug; details are in the publisher's log, not here
]


class StreamError(Message, kw_only=True):
    """The stream ends in failure; tokens already sent stay valid."""

    request_id: RequestId
    seq: Seq
    code: StreamErrorCode
    message: Reason
    usage: Usage | None = None
    worker_id: WorkerId | None = None  # None: the dispatcher's (it owns the request: never stale)
    attempt: Attempt = 0  # a worker's: its assignment, fenced like its chunks
    handover: Handover = 0

    @property
    def final(self) -> bool:
        return True


class StreamReassigned(Message, kw_only=True):
    """From the dispatcher, before a re-dispatch's Assignment: from `from_seq` on, the stream
    belongs to `attempt`; messages of older attempts at or past `from_seq` are stale."""

    request_id: RequestId
    attempt: Attempt
    from_seq: Seq
    worker_id: WorkerId | None = None  # the worker given up on

    @property
    def final(self) -> bool:
        return False


StreamMessage = TokenChunk | StreamError | StreamReassigned

AbortReason = Literal["client_disconnected", "cancelled", "deadline", "superseded"]


class AbortRequest(Message, kw_only=True):
    """Stop generating `request_id` and free its KV (within one engine step).

    With `worker_id` set (reason `superseded`: the dispatcher telling a worker it gave up on),
    only that worker acts, and only on an assignment older than (`attempt`, `handover`): a
    stale copy stops, the current one (even on the same worker) goes on, and the dispatcher
    keeps the request."""

    request_id: RequestId
    reason: AbortReason = "cancelled"
    ts: Timestamp
    worker_id: WorkerId | None = None
    attempt: Attempt = 0
    handover: Handover = 0

    @property
    def targeted(self) -> bool:
        return self.worker_id is not None

    def stops(self, worker_id: str, attempt: int, handover: int) -> bool:
        """Whether the assignment (`attempt`, `handover`) on `worker_id` must stop."""
        if self.worker_id is None:
            return True
        return self.worker_id == worker_id and (attempt, handover) < (self.attempt, self.handover)


__all__ = [
    "AbortReason",
    "AbortRequest",
    "FinishReason",
    "StreamError",
    "StreamErrorCode",
    "StreamMessage",
    "StreamReassigned",
    "TokenChunk",
]

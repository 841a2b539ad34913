"""Family `stream`: a request's tokens on `tidal.v1.req.<request_id>.out` and its abort.

A worker publishes `TokenChunk`s numbered `seq` = 0, 1, 2, ... with no gap, across
re-dispatches and migrations (the next owner continues the numbering). The last message of
a stream is either a `TokenChunk` with `finish_reason` and `usage` set, or a `StreamError`.
A consumer drops a chunk whose `seq` it has already seen (at-least-once is safe) and
treats a gap as lost messages.
"""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from shared.events.base import (
    MAX_CHUNK_TOKENS, Message, Reason, RequestId, Seq, Text, Timestamp, TokenId, WorkerId,
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

    @property
    def final(self) -> bool:
        return True


StreamMessage = TokenChunk | StreamError

AbortReason = Literal["client_disconnected", "cancelled", "deadline"]


class AbortRequest(Message, kw_only=True):
    """Stop generating `request_id` and free its KV (within one engine step)."""

    request_id: RequestId
    reason: AbortReason = "cancelled"
    ts: Timestamp


__all__ = [
    "AbortReason",
    "AbortRequest",
    "FinishReason",
    "StreamError",
    "StreamErrorCode",
    "StreamMessage",
    "TokenChunk",
]

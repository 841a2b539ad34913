"""Engine outputs → encoded `TokenChunk`s on `tidal.v1.req.<request_id>.out`, coalesced.

Runs on an instance's engine thread, right after each step, so the asyncio side only hands
ready bytes to NATS. Every message costs CPU and a wake-up on each hop (worker publish, NATS
twice, the gateway, the dispatcher, the client), so tokens are coalesced (vLLM's
`stream_interval`, in time): a request's first token goes out at once (TTFT); later tokens
wait for the instance's next flush, the first step `interval_s` after the oldest held token,
when every request with held tokens gets one chunk — one burst per interval instead of a
trickle every step, so each hop wakes once per burst. Held tokens also go out with the
final chunk, before a `StreamError`, and when the request is detached (migration). Sequence
numbers stay consecutive from the assignment's `next_seq`; `worker_id` and the assignment's
(`attempt`, `handover`) are set, the fence consumers drop a superseded copy by; the last
chunk carries finish_reason + usage, or is a `StreamError` when the engine could not run the
request. `interval_s = 0` sends one chunk per request per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.gpu_worker.engine.outputs import RequestOutput
from shared.events import StreamError, TokenChunk, TokenLogprobs, TopLogprob, Usage
from shared.events.base import MAX_CHUNK_TOKENS, MAX_TEXT_CHARS  # a chunk's bounds (a final one adds a few)
from shared.subjects import request_out
from shared.wire import encode

# (subject, payload) pairs to publish in order, and the ids of requests that ended.
Payload = tuple[str, bytes]

_MAX_ERROR_CHARS = 2000


@dataclass(slots=True)
class RequestStream:
    """What the worker remembers about one request's stream, with its un-sent tokens."""

    request_id: str
    subject: str
    next_seq: int
    want_logprobs: bool
    attempt: int = 0  # the assignment its chunks are fenced by (shared/events/stream.py)
    handover: int = 0
    started: bool = False  # a token went out (the first one is never held back)
    token_ids: list[int] = field(default_factory=list)  # pending: generated, not yet sent
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class StreamEncoder:
    """Per-instance stream state; owned by the engine thread. Pure: time is passed in."""

    def __init__(self, worker_id: str, interval_s: float = 0.0) -> None:
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.streams: dict[str, RequestStream] = {}
        self.tokens_emitted = 0  # every token generated for a served request, for tokens/s in stats
        self._pending: dict[str, RequestStream] = {}  # streams holding un-sent tokens
        self._flush_at = 0.0  # monotonic time of the next flush of every pending stream

    def open(self, request_id: str, next_seq: int, want_logprobs: bool, epoch: tuple[int, int] = (0, 0)) -> None:
        """`epoch`: the assignment's (attempt, handover), which every message of the stream carries."""
        self.streams[request_id] = RequestStream(request_id, request_out(request_id), next_seq, want_logprobs,
                                                 attempt=epoch[0], handover=epoch[1])

    def error(self, request_id: str, message: str, next_seq: int, epoch: tuple[int, int] = (0, 0)) -> Payload:
        """A stream that ends before it started (the engine refused the request)."""
        self.streams.pop(request_id, None)
        self._pending.pop(request_id, None)
        msg = StreamError(request_id=request_id, seq=next_seq, code="internal", message=message[:_MAX_ERROR_CHARS],
                          worker_id=self.worker_id, attempt=epoch[0], handover=epoch[1])
        return request_out(request_id), encode(msg)

    def detach(self, request_id: str) -> tuple[Payload | None, int] | None:
        """Forget a request whose stream goes on elsewhere (migration): its pending tokens as a
        chunk to send first (None if none), and the seq its next chunk must have."""
        stream = self.streams.pop(request_id, None)
        if stream is None:
            return None
        self._pending.pop(request_id, None)
        payload = self._chunk(stream, None, None) if stream.token_ids or stream.text else None
        return payload, stream.next_seq

    def encode_outputs(self, outputs: list[RequestOutput], now: float, payloads: list[Payload],
                       ended: list[str]) -> int:
        """Append the payloads due at `now` (monotonic seconds) in order, finished ids to `ended`;
        returns how many of the payloads are first tokens."""
        streams, pending = self.streams, self._pending
        firsts = 0
        for out in outputs:
            rid = out.request_id
            stream = streams.get(rid)
            if stream is None:
                continue  # not a served request (e.g. a warm-up), or detached
            new = out.new_token_ids
            self.tokens_emitted += len(new)
            if out.finished:
                del streams[rid]
                ended.append(rid)
                pending.pop(rid, None)
                self._add(stream, out)
                if out.finish_reason != "error":
                    usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
                    payloads.append(self._chunk(stream, out.finish_reason, usage))
                    continue
                if stream.token_ids or stream.text:  # what it made stays valid: sent before the error
                    payloads.append(self._chunk(stream, None, None))
                msg = StreamError(
                    request_id=rid, seq=stream.next_seq, code="internal",
                    message=(out.error or "the engine could not run this request")[:_MAX_ERROR_CHARS],
                    usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens),
                    worker_id=self.worker_id, attempt=stream.attempt, handover=stream.handover,
                )
                payloads.append((stream.subject, encode(msg)))
                continue
            if not new and not out.new_text:
                continue
            self._add(stream, out)
            if not stream.started:
                stream.started = True
                firsts += 1
                payloads.append(self._chunk(stream, None, None))
            elif len(stream.token_ids) >= MAX_CHUNK_TOKENS // 2 or len(stream.text) >= MAX_TEXT_CHARS // 2:
                pending.pop(rid, None)
                payloads.append(self._chunk(stream, None, None))
            else:
                if not pending:  # the oldest held token waits about one interval
                    self._flush_at = now + self.interval_s
                pending[rid] = stream
        if pending and now >= self._flush_at:
            for stream in pending.values():
                payloads.append(self._chunk(stream, None, None))
            pending.clear()
        return firsts

    @staticmethod
    def _add(stream: RequestStream, out: RequestOutput) -> None:
        if out.new_token_ids:
            stream.token_ids.extend(out.new_token_ids)
            if stream.want_logprobs:
                stream.logprobs.extend(_logprobs(out))
        stream.text += out.new_text

    def _chunk(self, stream: RequestStream, finish_reason: str | None, usage: Usage | None) -> Payload:
        """The pending tokens as the stream's next chunk (and reset them)."""
        chunk = TokenChunk(
            request_id=stream.request_id, seq=stream.next_seq, token_ids=stream.token_ids, text=stream.text,
            logprobs=stream.logprobs if stream.want_logprobs else None,
            finish_reason=finish_reason, usage=usage, worker_id=self.worker_id,  # type: ignore[arg-type]
            attempt=stream.attempt, handover=stream.handover,
        )
        stream.next_seq += 1
        stream.token_ids, stream.text, stream.logprobs = [], "", []
        return stream.subject, encode(chunk)


def _logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    values = out.logprobs or [0.0] * len(out.new_token_ids)
    tops = out.top_logprobs or [None] * len(out.new_token_ids)
    return [
        TokenLogprobs(
            token_id=token, logprob=min(0.0, value),
            top=[TopLogprob(token_id=t, logprob=min(0.0, lp)) for t, lp in (top or [])],
        )
        for token, value, top in zip(out.new_token_ids, values, tops)
    ]

"""Engine outputs → encoded `TokenChunk`s on `tidal.v1.req.<request_id>.out`.

Runs on an instance's engine thread, right after each step, so the asyncio side only hands
ready bytes to NATS: one chunk per request per step (that step's tokens and text), `seq`
consecutive from the assignment's `next_seq`, `worker_id` set; the last chunk carries
finish_reason + usage, or is a `StreamError` when the engine could not run the request.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.gpu_worker.engine.outputs import RequestOutput
from shared.events import StreamError, TokenChunk, TokenLogprobs, TopLogprob, Usage
from shared.subjects import request_out
from shared.wire import encode

# (subject, payload) pairs to publish in order, and the ids of requests that ended.
Payload = tuple[str, bytes]

_MAX_ERROR_CHARS = 2000


@dataclass(slots=True)
class RequestStream:
    """What the worker remembers about one request's stream."""

    request_id: str
    subject: str
    next_seq: int
    want_logprobs: bool


class StreamEncoder:
    """Per-instance stream state; owned by the engine thread."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.streams: dict[str, RequestStream] = {}
        self.tokens_emitted = 0  # every token published, for tokens/s in stats

    def open(self, request_id: str, next_seq: int, want_logprobs: bool) -> None:
        self.streams[request_id] = RequestStream(request_id, request_out(request_id), next_seq, want_logprobs)

    def error(self, request_id: str, message: str, next_seq: int) -> Payload:
        """A stream that ends before it started (the engine refused the request)."""
        self.streams.pop(request_id, None)
        msg = StreamError(request_id=request_id, seq=next_seq, code="internal", message=message[:_MAX_ERROR_CHARS])
        return request_out(request_id), encode(msg)

    def encode_outputs(self, outputs: list[RequestOutput], payloads: list[Payload], ended: list[str]) -> None:
        """Append one payload per output (in order) to `payloads`; finished ids to `ended`."""
        streams = self.streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue  # not a served request (e.g. a warm-up)
            if out.finished:
                del streams[out.request_id]
                ended.append(out.request_id)
            if out.finish_reason == "error":
                msg = StreamError(
                    request_id=out.request_id, seq=stream.next_seq, code="internal",
                    message=(out.error or "the engine could not run this request")[:_MAX_ERROR_CHARS],
                    usage=Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens),
                )
                payloads.append((stream.subject, encode(msg)))
                continue
            n = len(out.new_token_ids)
            if not n and not out.new_text and not out.finished:
                continue
            self.tokens_emitted += n
            usage = None
            if out.finished:
                usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
            chunk = TokenChunk(
                request_id=out.request_id, seq=stream.next_seq, token_ids=out.new_token_ids, text=out.new_text,
                logprobs=_logprobs(out) if stream.want_logprobs else None,
                finish_reason=out.finish_reason if out.finished else None,  # type: ignore[arg-type]
                usage=usage, worker_id=self.worker_id,
            )
            stream.next_seq += 1
            payloads.append((stream.subject, encode(chunk)))


def _logprobs(out: RequestOutput) -> list[TokenLogprobs]:
    if not out.new_token_ids:
        return []
    values = out.logprobs or [0.0] * len(out.new_token_ids)
    tops = out.top_logprobs or [None] * len(out.new_token_ids)
    return [
        TokenLogprobs(
            token_id=token, logprob=min(0.0, value),
            top=[TopLogprob(token_id=t, logprob=min(0.0, lp)) for t, lp in (top or [])],
        )
        for token, value, top in zip(out.new_token_ids, values, tops)
    ]

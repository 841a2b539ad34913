"""Drive a Generation to the client: as SSE events (streaming) or collected into one body.

The endpoint-specific part (completions vs chat chunk shapes) is a `Format`; this module owns
what both share: ordering, TTFT and token metrics, include_usage, in-stream errors, `[DONE]`,
and what a client disconnect or the request deadline does.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec

from services.gateway.api_common import StreamOptions, UsageInfo
from services.gateway import vllm_metrics
from services.gateway.errors import ApiError
from services.gateway.generation import Abandoned, Choice, Generation
from services.gateway.metrics import GENERATED_TOKENS, TPOT_SECONDS, TTFT_SECONDS
from services.gateway.sse import DONE, event, event_stream, wait_disconnect
from services.gateway.stream_guard import StreamStalled, progress_guarded
from shared.events.stream import StreamError, TokenChunk

encoder = msgspec.json.Encoder()


class Format(Protocol):
    def head(self) -> bytes:
        """Events before any token (chat: the assistant role delta); may be empty."""

    def chunk(self, choice: Choice, msg: TokenChunk) -> bytes | None:
        """One `data:` event for a chunk, or None when it carries nothing to show."""

    def usage_event(self, usage: UsageInfo) -> bytes: ...


class ClientGone(Exception):
    """The client disconnected before the (non-streamed) answer was ready."""


def usage_info(gen: Generation) -> UsageInfo:
    prompt, completion = gen.usage()
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def stream_error(msg: StreamError) -> ApiError:
    """A StreamError as the error the client sees (in-stream, or as the HTTP status if not streaming)."""
    match msg.code:
        case "redispatch_limit":
            return ApiError.unavailable("redispatch_limit", "The workers serving this request failed too often; "
                                        "tokens already sent are valid.", 1.0)
        case "worker_lost":
            return ApiError.unavailable("worker_lost", "The worker serving this request was lost and the stream "
                                        "could not be continued exactly; tokens already sent are valid.", 1.0)
        case "queue_timeout":
            return ApiError.unavailable("queue_timeout", "The request waited too long for capacity.", 1.0)
    return ApiError.internal()


def abandoned_error(reason: str) -> ApiError:
    if reason == "deadline":
        return ApiError(504, "The request did not finish within the gateway's request timeout.", type="timeout",
                        code="request_timeout")
    return ApiError.unavailable("draining", "The gateway is shutting down; retry the request.", 1.0)


class Metering:
    """TTFT (arrival to the first token), TPOT (per finished choice) and token counts for one generation."""

    def __init__(self, route: str, arrival: float, model: str = "") -> None:
        self.arrival = arrival
        self.model = model
        self.first = False
        self.first_at: dict[int, tuple[float, int]] = {}  # choice index -> (its first chunk's time, tokens since)
        self.ttft = TTFT_SECONDS.labels(route)
        self.tpot = TPOT_SECONDS.labels(route)
        self.tokens = GENERATED_TOKENS.labels(route)
        # vLLM's names (vllm_metrics.py), by the base model
        self.vllm_ttft = vllm_metrics.TTFT.labels(model)
        self.vllm_tpot = vllm_metrics.TPOT.labels(model)
        self.vllm_tokens = vllm_metrics.GENERATION_TOKENS.labels(model)

    def saw(self, msg: TokenChunk, choice: int = 0) -> None:
        if msg.token_ids:
            now = time.perf_counter()
            if not self.first:
                self.first = True
                self.ttft.observe(now - self.arrival)
                self.vllm_ttft.observe(now - self.arrival)
            started, later = self.first_at.get(choice, (now, -len(msg.token_ids)))
            self.first_at[choice] = (started, later + len(msg.token_ids))
            self.tokens.inc(len(msg.token_ids))
            self.vllm_tokens.inc(len(msg.token_ids))
        if msg.finish_reason is not None:
            vllm_metrics.REQUEST_SUCCESS.labels(self.model, msg.finish_reason).inc()
        if msg.finish_reason is not None and choice in self.first_at:
            started, later = self.first_at.pop(choice)
            if later > 0:
                tpot = (time.perf_counter() - started) / later
                self.tpot.observe(tpot)
                self.vllm_tpot.observe(tpot)

    def finished(self, gen: Generation) -> None:
        """Every choice has its final chunk: the request's end-to-end latency and prompt tokens."""
        vllm_metrics.E2E.labels(self.model).observe(time.perf_counter() - self.arrival)
        vllm_metrics.PROMPT_TOKENS.labels(self.model).inc(gen.usage()[0])


def stream_response(gen: Generation, fmt: Format, meter: Metering, options: StreamOptions | None) -> Any:
    """The SSE response of a streaming request; a client that goes away aborts its generation."""

    async def on_disconnect() -> None:
        await gen.abandon("client_disconnected")

    include_usage = bool(options and options.include_usage)
    return event_stream(sse_events(gen, fmt, meter, include_usage=include_usage), on_disconnect, gen.close)


async def sse_events(gen: Generation, fmt: Format, meter: Metering, *, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        head = fmt.head()
        if head:
            yield head
        async for batch in progress_guarded(gen, gen.batches(), gen.stall_timeout_s):
            parts: list[bytes] = []
            failed: StreamError | None = None
            for choice, msg in batch:
                if isinstance(msg, StreamError):
                    failed = msg
                    break
                meter.saw(msg, choice.index)
                part = fmt.chunk(choice, msg)
                if part is not None:
                    parts.append(part)
            if parts:
                yield b"".join(parts)
            if failed is not None:
                await gen.abandon("cancelled")
                yield event(stream_error(failed).encode()) + DONE
                return
        meter.finished(gen)
        if include_usage:
            yield fmt.usage_event(usage_info(gen))
        yield DONE
    except Abandoned as exc:
        if exc.reason != "client_disconnected":
            yield event(abandoned_error(exc.reason).encode()) + DONE
    except StreamStalled as exc:
        yield event(exc.error.encode()) + DONE
    finally:
        await gen.close()


async def collect(gen: Generation, meter: Metering, receive: Callable[[], Awaitable[dict[str, Any]]],
                  on_chunk: Callable[[Choice, TokenChunk], None]) -> None:
    """Feed every chunk to `on_chunk` until all choices finish; watches for the client leaving meanwhile."""
    gone = False

    async def disconnected() -> None:
        nonlocal gone
        gone = True
        await gen.abandon("client_disconnected")

    watcher = asyncio.ensure_future(wait_disconnect(receive, disconnected))
    try:
        async for batch in progress_guarded(gen, gen.batches(), gen.stall_timeout_s):
            for choice, msg in batch:
                if isinstance(msg, StreamError):
                    await gen.abandon("cancelled")
                    raise stream_error(msg)
                meter.saw(msg, choice.index)
                on_chunk(choice, msg)
        meter.finished(gen)
    except Abandoned as exc:
        if gone or exc.reason == "client_disconnected":
            raise ClientGone() from None
        raise abandoned_error(exc.reason) from None
    except StreamStalled as exc:
        raise exc.error from None
    finally:
        watcher.cancel()
        await gen.close()


__all__ = ["ClientGone", "Format", "Metering", "collect", "encoder", "sse_events", "stream_error", "usage_info"]

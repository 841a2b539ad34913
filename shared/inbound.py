"""The receiving side of the bus: what a handler sees (`Delivery`) and how each message is processed.

For every message of a subscription, `Inbound.process` checks the `tidal-deadline` header
(a message whose caller already gave up is answered `deadline_exceeded` and not handled),
decodes the payload with the subscription's own typed decoder, binds `request_id`, the
deadline and the trace context for the handler's duration, calls the handler, and answers:
the returned Struct, or an `ErrorReply` when decoding failed (`bad_request`,
`unknown_message`), when the handler raised a `TidalError` (its code) or anything else
(`internal`, traceback only in the log). Every failure is counted in
`tidal_message_errors_total{service, subject, reason}` and logged; none escapes.
"""
from __future__ import annotations

import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import msgspec
import nats.errors
from nats.aio.msg import Msg

from shared import metrics
from shared.logging import get_logger, request_id_var, traceparent_var
from shared.tracing import CONSUMER, SERVER, extract
from shared.wire import (
    BAD_REQUEST, DEADLINE_EXCEEDED, HDR_DEADLINE, HDR_IDEMPOTENCY_KEY, HDR_REQUEST_ID, HDR_TRACEPARENT, INTERNAL,
    ErrorReply, TidalError, encode, error_for_decode_failure, tag_fields,
)

if TYPE_CHECKING:
    from shared.bus import Bus

log = get_logger("tidal.bus")

# Absolute deadline (epoch seconds) of the message being handled; bounds nested requests.
deadline_var: ContextVar[float | None] = ContextVar("tidal_deadline", default=None)


class Delivery:
    """What a handler knows about the message besides its payload."""

    __slots__ = ("subject", "reply", "headers", "deadline")

    def __init__(self, subject: str, reply: str, headers: dict[str, str] | None, deadline: float | None) -> None:
        self.subject = subject
        self.reply = reply  # "" for pub/sub
        self.headers = headers
        self.deadline = deadline  # absolute, epoch seconds; None when the sender set none

    @property
    def expects_reply(self) -> bool:
        return bool(self.reply)

    @property
    def request_id(self) -> str | None:
        return self.headers.get(HDR_REQUEST_ID) if self.headers else None

    @property
    def idempotency_key(self) -> str | None:
        return self.headers.get(HDR_IDEMPOTENCY_KEY) if self.headers else None

    def remaining(self) -> float | None:
        """Seconds left before the caller gives up (None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.time()


Handler = Callable[[Any, Delivery], Awaitable[msgspec.Struct | None]]


class Mailbox(Protocol):
    """Where a subscription's messages are processed (the actor runtime provides one)."""

    async def deliver(self, process: Callable[[Msg], Awaitable[None]], raw: Msg) -> None: ...


class Inbound:
    """Decode → check deadline → handle → reply, for one subscription. Never raises."""

    def __init__(self, bus: "Bus", label: str, msg_type: Any, handler: Handler) -> None:
        self.bus = bus
        self.label = label
        self.decoder = msgspec.msgpack.Decoder(msg_type)  # one per subscription
        self.tags = tag_fields(msg_type)
        self.handler = handler
        self.seconds = metrics.HANDLE_SECONDS.labels(bus.service, label)  # its _count: messages handled

    async def process(self, raw: Msg) -> None:
        headers = raw.headers
        deadline = None
        if headers:
            text = headers.get(HDR_DEADLINE)
            if text is not None:
                try:
                    deadline = int(text) / 1000.0
                except ValueError:
                    problem = f"bad {HDR_DEADLINE} header {text!r}: expected epoch milliseconds"
                    await self.reject(raw, ErrorReply(code=BAD_REQUEST, message=problem, field=HDR_DEADLINE))
                    return
                if time.time() >= deadline:  # the caller already gave up: skip the work
                    await self.reject(raw, ErrorReply(code=DEADLINE_EXCEEDED, message="deadline passed before handling"))
                    return
        try:
            msg = self.decoder.decode(raw.data)
        except msgspec.MsgspecError as exc:
            await self.reject(raw, error_for_decode_failure(exc, self.tags))
            return
        ctx = Delivery(raw.subject, raw.reply, headers, deadline)
        tracing = self.bus.tracing
        if not headers and tracing is None:
            await self.invoke(msg, ctx)  # fast path: nothing to bind
            return
        # Bind only what the message carries: the subscription task starts from an empty context
        # and every binding is undone after the message, so an unset variable is already None.
        deadline_token = deadline_var.set(deadline) if deadline is not None else None
        request_id = headers.get(HDR_REQUEST_ID) if headers else None
        request_token = request_id_var.set(request_id) if request_id is not None else None
        try:
            if tracing is None:
                parent = headers.get(HDR_TRACEPARENT)  # type: ignore[union-attr]  # headers is set here
                if parent is None:
                    await self.invoke(msg, ctx)
                else:
                    parent_token = traceparent_var.set(parent)  # forwarded as-is on outgoing messages
                    try:
                        await self.invoke(msg, ctx)
                    finally:
                        traceparent_var.reset(parent_token)
            else:
                with tracing.tracer.start_as_current_span(
                    f"{self.label} process", context=extract(headers), kind=SERVER if raw.reply else CONSUMER,
                    attributes={"messaging.system": "nats", "messaging.destination.name": raw.subject},
                ):
                    await self.invoke(msg, ctx)
        finally:
            if request_token is not None:
                request_id_var.reset(request_token)
            if deadline_token is not None:
                deadline_var.reset(deadline_token)

    async def invoke(self, msg: Any, ctx: Delivery) -> None:
        started = time.perf_counter()
        try:
            result = await self.handler(msg, ctx)
        except TidalError as exc:
            self.seconds.observe(time.perf_counter() - started)
            error = exc.to_reply()
            log.warning("handler refused message", subject=ctx.subject, code=error.code, error=error.message)
        except Exception:
            self.seconds.observe(time.perf_counter() - started)
            log.exception("handler failed", subject=ctx.subject, message_type=type(msg).__name__)
            error = ErrorReply(code=INTERNAL, message=f"internal error handling {type(msg).__name__}")
        else:
            self.seconds.observe(time.perf_counter() - started)
            if result is not None and ctx.reply:
                try:  # Bus.respond, inlined: this is the hot path
                    await self.bus.nc.publish(ctx.reply, encode(result))
                except nats.errors.Error as exc:
                    log.warning("reply not sent", subject=ctx.subject, error=repr(exc))
            return
        metrics.MESSAGE_ERRORS.labels(self.bus.service, self.label, error.code).inc()
        if ctx.reply:
            await self.bus.respond_error(ctx.reply, error)

    async def reject(self, raw: Msg, error: ErrorReply) -> None:
        metrics.MESSAGE_ERRORS.labels(self.bus.service, self.label, error.code).inc()
        log.warning("message rejected", subject=raw.subject, code=error.code, error=error.message, field=error.field)
        if raw.reply:
            await self.bus.respond_error(raw.reply, error)

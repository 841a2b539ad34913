"""The NATS bus: one connection per process, typed publish / subscribe / request on msgspec Structs.

    bus = await Bus.connect(BusSettings(url=...), service="dispatcher")
    await bus.publish("tidal.v1.evt.worker.heartbeat", Heartbeat(...))
    await bus.subscribe("tidal.v1.dispatch.submit", SubmitRequest, handle, queue="dispatcher")
    reply = await bus.request("tidal.v1.registry.get", GetModel(name="m"), ModelRecord, timeout=1.0)
    models = await bus.kv("models", ModelRecord)          # typed JetStream KV (see shared/kv.py)

Handlers are `async def handle(msg: T, ctx: Delivery) -> Struct | None`; a returned Struct
answers the request. Undecodable input, an unknown tag, an expired deadline and handler
exceptions are answered with a typed `ErrorReply` (where a reply is expected), counted in
`tidal_message_errors_total` and logged; they never stop the subscription.

Every request has a deadline (default `BusSettings.request_timeout_s`); it travels in the
`tidal-deadline` header, and a request made while handling a message never outlives the
deadline of the message being handled. `request()` raises `DeadlineExceeded`, `NoResponders`
or `RemoteError` (with `.code`). Raw nats-py stays reachable as `bus.nc` and `bus.js`.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import random
import time
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import JetStreamContext

from shared import metrics
from shared.inbound import Delivery, Handler, Inbound, Mailbox, deadline_var
from shared.logging import get_logger, request_id_var, traceparent_var
from shared.nats_credentials import split_credentials
from shared.reply_mux import NoRespondersStatus, ReplyMux, ReplyTimeout
from shared.tracing import CLIENT, PRODUCER, Tracing, inject
from shared.url_credentials import redact
from shared.wire import (
    DEADLINE_EXCEEDED, HDR_DEADLINE, HDR_ERROR, HDR_IDEMPOTENCY_KEY, HDR_REQUEST_ID, HDR_TRACEPARENT, UNAVAILABLE,
    BadReply, DeadlineExceeded, ErrorReply, NoResponders, RemoteError, Unavailable, decode_error_reply, decoder_for,
    encode,
)

if TYPE_CHECKING:
    from shared.kv import KVBucket

__all__ = ["Bus", "BusSettings", "Delivery", "Handler", "Mailbox", "Subscription", "deadline_var"]

T = TypeVar("T")
R = TypeVar("R")
log = get_logger("tidal.bus")


@functools.lru_cache(maxsize=None)
def _carries_idempotency_key(msg_type: type) -> bool:
    return "idempotency_key" in getattr(msg_type, "__struct_fields__", ())


class BusSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Connection and request defaults. `from_env()` reads TIDAL_NATS_URL / TIDAL_REQUEST_TIMEOUT_S."""

    url: str = "nats://127.0.0.1:4222"
    request_timeout_s: float = 5.0  # default deadline of every request
    connect_timeout_s: float = 2.0  # one TCP connect attempt
    initial_connect_s: float = 30.0  # keep retrying the first connect this long (NATS may start later)
    initial_retry_s: float = 0.25  # pause between first-connect attempts
    reconnect_wait_s: float = 0.1  # first reconnect backoff; doubles per failed attempt, with jitter
    reconnect_wait_max_s: float = 5.0
    max_reconnect_attempts: int = -1  # -1: reconnect forever
    # A dead link (a partition, no RST) is noticed after about ping_interval_s x (max_outstanding_pings
    # + 1) and the client reconnects; nats-py's default (2 min) left a cut-off worker generating for
    # minutes. Kept well above a busy box's event-loop stalls: a spurious reconnect loses messages.
    # A worker fences itself sooner, from its own round trips (services/gpu_worker/bus_watch.py).
    ping_interval_s: int = 5
    max_outstanding_pings: int = 2
    drain_timeout_s: float = 10.0  # bound on draining the connection at close
    pending_msgs_limit: int = 65536  # per subscription, before NATS calls us a slow consumer

    @classmethod
    def from_env(cls, **overrides: Any) -> "BusSettings":
        env: dict[str, Any] = {}
        if "TIDAL_NATS_URL" in os.environ:
            env["url"] = os.environ["TIDAL_NATS_URL"]
        if "TIDAL_REQUEST_TIMEOUT_S" in os.environ:
            env["request_timeout_s"] = float(os.environ["TIDAL_REQUEST_TIMEOUT_S"])
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**env)


class Subscription:
    """A typed subscription; `drain()` stops receiving and finishes what was received."""

    def __init__(self, subject: str, queue: str | None, sub: NatsSubscription) -> None:
        self.subject = subject
        self.queue = queue
        self.nats_sub = sub

    async def drain(self) -> None:
        try:
            await self.nats_sub.drain()
        except (nats.errors.BadSubscriptionError, nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            pass  # already gone

    async def unsubscribe(self) -> None:
        """Stop receiving; messages received but not yet handled are dropped."""
        try:
            await self.nats_sub.unsubscribe()
        except (nats.errors.BadSubscriptionError, nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
            pass

    def abort(self) -> None:
        """Stop processing now, even in the middle of a drain (cancels the handler in progress)."""
        # nats-py has no public call for this: a cancelled drain leaves the processing task running.
        self.nats_sub._stop_processing()
        self.nats_sub._conn._remove_sub(self.nats_sub._id)


class Bus:
    """One NATS connection for a process. Build with `await Bus.connect(...)`."""

    def __init__(self, nc: Client, settings: BusSettings, service: str, tracing: Tracing | None) -> None:
        self.nc = nc  # raw nats-py escape hatch
        self.settings = settings
        self.service = service
        self.tracing = tracing
        self._js: JetStreamContext | None = None
        self._replies = ReplyMux(nc)
        self._closing = False
        self._last_error: tuple[str, float] = ("", 0.0)
        self._request_latency: dict[str, Any] = {}  # subject -> histogram child (label lookup is not free)

    # --- connection ---------------------------------------------------------------------
    @classmethod
    async def connect(
        cls, settings: BusSettings | None = None, *, service: str = "tidal", tracing: Tracing | None = None,
        name: str | None = None,
    ) -> "Bus":
        """Connect (retrying for `initial_connect_s`), with infinite reconnect and logged callbacks."""
        settings = settings or BusSettings.from_env()
        nc = Client()
        bus = cls(nc, settings, service, tracing)
        # comma-separated servers (a NATS cluster); credentials as options, so discovered servers get them too
        servers, user, password = split_credentials(settings.url)
        auth: dict[str, str] = {} if user is None else {"token": user} if password is None else \
            {"user": user, "password": password}
        try:
            await asyncio.wait_for(
                nc.connect(
                    servers, **auth, name=name or service, error_cb=bus._on_error, disconnected_cb=bus._on_disconnected,
                    reconnected_cb=bus._on_reconnected, closed_cb=bus._on_closed,
                    connect_timeout=settings.connect_timeout_s, reconnect_time_wait=settings.initial_retry_s,
                    max_reconnect_attempts=settings.max_reconnect_attempts, ping_interval=settings.ping_interval_s,
                    max_outstanding_pings=settings.max_outstanding_pings,
                    reconnect_to_server_handler=bus._pick_server, drain_timeout=settings.drain_timeout_s,
                ),
                settings.initial_connect_s,
            )
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            await nc.close()
            raise Unavailable(f"cannot connect to NATS at {redact(settings.url)} within {settings.initial_connect_s}s: "
                              f"{redact(repr(exc))}") from exc
        await asyncio.get_running_loop().create_task(bus._replies.start(), context=contextvars.Context())
        log.info("bus connected", url=redact(settings.url), service=service)
        return bus

    def _pick_server(self, servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
        # Exponential backoff with jitter; the least-tried server of the pool goes next.
        server = min(servers, key=lambda s: s.reconnects)
        wait = min(self.settings.reconnect_wait_max_s, self.settings.reconnect_wait_s * (2 ** min(server.reconnects, 16)))
        return server, wait * random.uniform(0.5, 1.0)

    async def _on_error(self, exc: Exception) -> None:
        metrics.BUS_EVENTS.labels(self.service, "error").inc()
        text, now = repr(exc), time.monotonic()
        last_text, last_at = self._last_error
        if text == last_text and now - last_at < 10.0:
            return  # the same error again (e.g. every retry while NATS is down): logged once per 10 s
        self._last_error = (text, now)
        log.warning("bus error", error=text)

    async def _on_disconnected(self) -> None:
        if self._closing:
            return
        metrics.BUS_EVENTS.labels(self.service, "disconnected").inc()
        log.warning("bus disconnected", url=redact(self.settings.url))

    async def _on_reconnected(self) -> None:
        metrics.BUS_EVENTS.labels(self.service, "reconnected").inc()
        log.info("bus reconnected", url=redact(str(self.nc.connected_url.geturl() if self.nc.connected_url else "")))

    async def _on_closed(self) -> None:
        metrics.BUS_EVENTS.labels(self.service, "closed").inc()
        if self._closing:
            log.info("bus closed")
        else:
            log.warning("bus closed: no server reachable any more")

    @property
    def js(self) -> JetStreamContext:
        """JetStream context (raw escape hatch)."""
        if self._js is None:
            self._js = self.nc.jetstream(timeout=self.settings.request_timeout_s)
        return self._js

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    async def close(self) -> None:
        """Drain subscriptions and pending publishes, then close (idempotent)."""
        if self.nc.is_closed:
            return
        self._closing = True
        try:
            await asyncio.wait_for(self.nc.drain(), self.settings.drain_timeout_s + 1.0)
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            if not isinstance(exc, nats.errors.ConnectionReconnectingError):
                log.warning("bus drain incomplete", error=repr(exc))
        if not self.nc.is_closed:
            await self.nc.close()

    # --- typed messaging ----------------------------------------------------------------
    def _outgoing_headers(self, headers: dict[str, str] | None) -> dict[str, str] | None:
        request_id = request_id_var.get()
        if request_id is not None:
            headers = dict(headers) if headers else {}
            headers.setdefault(HDR_REQUEST_ID, request_id)
        if self.tracing is None:
            parent = traceparent_var.get()
            if parent is not None:
                headers = dict(headers) if headers else {}
                headers.setdefault(HDR_TRACEPARENT, parent)
        return headers

    async def publish(self, subject: str, msg: msgspec.Struct, *, headers: dict[str, str] | None = None) -> None:
        """Publish an event (fire and forget)."""
        payload = encode(msg)
        headers = self._outgoing_headers(headers)
        if self.tracing is None:
            await self.nc.publish(subject, payload, headers=headers)
            return
        with self.tracing.tracer.start_as_current_span(
            f"{subject} publish", kind=PRODUCER,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):
            headers = dict(headers) if headers else {}
            inject(headers)
            await self.nc.publish(subject, payload, headers=headers)

    async def request(
        self, subject: str, msg: msgspec.Struct, reply_type: type[R] | Any, *, timeout: float | None = None,
        idempotency_key: str | None = None, headers: dict[str, str] | None = None,
    ) -> R:
        """Send a command/query and wait for its typed reply, at most until the deadline.

        The idempotency key defaults to the message's own `idempotency_key` field if it has one.
        Raises DeadlineExceeded, NoResponders, RemoteError (the responder's ErrorReply) or BadReply.
        """
        now = time.time()
        timeout = self.settings.request_timeout_s if timeout is None else timeout
        deadline = now + timeout
        upstream = deadline_var.get()
        if upstream is not None and upstream < deadline:
            deadline, timeout = upstream, upstream - now
            if timeout <= 0:
                raise DeadlineExceeded(f"{subject}: the deadline of the message being handled has passed")
        out = {HDR_DEADLINE: str(int(deadline * 1000))}
        if headers:
            out.update(headers)
        if idempotency_key is None and _carries_idempotency_key(type(msg)):
            idempotency_key = msg.idempotency_key  # type: ignore[attr-defined]
        if idempotency_key:
            out[HDR_IDEMPOTENCY_KEY] = str(idempotency_key)
        request_id = request_id_var.get()
        if request_id is not None:
            out.setdefault(HDR_REQUEST_ID, request_id)
        payload = encode(msg)
        if self.tracing is None:
            parent = traceparent_var.get()
            if parent is not None:
                out.setdefault(HDR_TRACEPARENT, parent)
            return await self._request(subject, payload, reply_type, timeout, out)
        with self.tracing.tracer.start_as_current_span(
            f"{subject} request", kind=CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):
            inject(out)
            return await self._request(subject, payload, reply_type, timeout, out)

    async def _request(self, subject: str, payload: bytes, reply_type: Any, timeout: float, headers: dict[str, str]) -> Any:
        started = time.perf_counter()
        try:
            resp = await self._replies.request(subject, payload, timeout, headers)
        except NoRespondersStatus:
            metrics.REQUEST_ERRORS.labels(self.service, subject, UNAVAILABLE).inc()
            raise NoResponders(subject) from None
        except ReplyTimeout:
            metrics.REQUEST_ERRORS.labels(self.service, subject, DEADLINE_EXCEEDED).inc()
            raise DeadlineExceeded(f"{subject}: no reply within {timeout:.3f}s") from None
        except nats.errors.Error as exc:  # closed, draining, reconnect buffer full, ...
            metrics.REQUEST_ERRORS.labels(self.service, subject, UNAVAILABLE).inc()
            raise Unavailable(f"{subject}: request not sent: {exc!r}") from exc
        if resp.headers and HDR_ERROR in resp.headers:
            error = decode_error_reply(resp.data)
            metrics.REQUEST_ERRORS.labels(self.service, subject, error.code).inc()
            raise RemoteError(subject, error)
        latency = self._request_latency.get(subject)
        if latency is None:
            if len(self._request_latency) > 4096:  # bound the cache if callers use per-request subjects
                self._request_latency.clear()
            latency = self._request_latency[subject] = metrics.REQUEST_SECONDS.labels(self.service, subject)
        latency.observe(time.perf_counter() - started)
        try:
            return decoder_for(reply_type).decode(resp.data)
        except msgspec.MsgspecError as exc:
            raise BadReply(f"{subject}: reply is not a valid {getattr(reply_type, '__name__', reply_type)}: {exc}") from None

    async def subscribe(
        self, subject: str, msg_type: Any, handler: Handler, *, queue: str | None = None, label: str | None = None,
        mailbox: Mailbox | None = None, flush: bool = True,
    ) -> Subscription:
        """Subscribe with typed decoding (`msg_type`: a Struct or a tagged union of Structs).

        `queue` joins a queue group (each message goes to one member). `label` names the
        subscription in metrics and spans (default: `subject`; pass a pattern for
        per-request subjects). `mailbox` routes processing through an actor's mailbox;
        without one, messages of this subscription are handled one at a time, in order.
        `flush=False` skips the round trip that makes the subscription active on the server
        before returning (safe when only this connection publishes to it afterwards).
        """
        inbound = Inbound(self, label or subject, msg_type, handler)
        if mailbox is None:
            callback = inbound.process
        else:
            process = inbound.process

            async def callback(raw: Msg) -> None:
                await mailbox.deliver(process, raw)

        # nats-py's processing task copies the caller's context: start it from an empty one, so a
        # subscription made inside a handler does not inherit that message's request id/deadline.
        sub = await asyncio.get_running_loop().create_task(
            self.nc.subscribe(subject, queue=queue or "", cb=callback, pending_msgs_limit=self.settings.pending_msgs_limit),
            context=contextvars.Context(),
        )
        if flush:  # a round trip, so the server routes to us once subscribe() returns
            await self.nc.flush(timeout=max(1, int(self.settings.request_timeout_s)))
        return Subscription(subject, queue, sub)

    async def respond(self, ctx: Delivery, msg: msgspec.Struct) -> None:
        """Answer a request explicitly (a handler may also just return the reply)."""
        try:
            await self.nc.publish(ctx.reply, encode(msg))
        except nats.errors.Error as exc:
            log.warning("reply not sent", subject=ctx.subject, error=repr(exc))

    async def respond_error(self, reply: str, error: ErrorReply) -> None:
        try:
            await self.nc.publish(reply, encode(error), headers={HDR_ERROR: error.code})
        except nats.errors.Error as exc:
            log.warning("error reply not sent", error=repr(exc))

    # --- JetStream KV -------------------------------------------------------------------
    async def kv(
        self, bucket: str, value_type: type[T], *, create: bool = True, history: int = 1, ttl_s: float | None = None,
        replicas: int = 1, storage: str = "file", description: str | None = None,
    ) -> "KVBucket[T]":
        """A typed KV bucket, created (file storage) if absent and `create`. See `shared.kv`."""
        from shared.kv import open_bucket

        return await open_bucket(
            self, bucket, value_type, create=create, history=history, ttl_s=ttl_s, replicas=replicas,
            storage=storage, description=description,
        )

"""The gateway's NATS side: submit a sequence, route its token chunks back, abort it.

One shared connection (the service's bus) and one msgpack decoder. Chunks of the requests
this gateway waits for reach a `Sink` (a plain callback, no task per chunk) either through:

* `wildcard` (default): one subscription to `tidal.v1.req.*.out` and a dict lookup by
  request id; chunks of requests this process does not know are dropped before decoding;
* `per_request`: one subscription per request on `tidal.v1.req.<id>.out`, removed when done.

`python -m services.gateway.bench_hub` compares the two (figures in docs/api.md): the wildcard
costs the gateway about 0.7x the CPU (no SUB/UNSUB and no nats-py task per request);
per-request subscriptions avoid the fan-out when many gateways share one NATS. Either way the request's
subscription exists before its submit is published on the same connection, so the server
routes every chunk of it to us.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from services.gateway.errors import log_failure
from shared import metrics
from shared.bus import Bus
from shared.events.dispatch import SubmitReply, SubmitRequest
from shared.events.stream import AbortReason, AbortRequest, StreamError, StreamReassigned, TokenChunk
from shared.logging import get_logger
from shared.subjects import CATALOG, dispatch_submit, request_abort, request_out

log = get_logger("tidal.gateway.hub")

StreamMsg = TokenChunk | StreamError | StreamReassigned  # the last: a re-dispatch's fence (seq_order.py)
Sink = Callable[[StreamMsg], None]
Mode = Literal["wildcard", "per_request"]

OUT = CATALOG["request.out"]
_PREFIX_LEN = len(OUT.template.split("<")[0])  # "tidal.v1.req."
_SUFFIX_LEN = len(OUT.template.split(">")[1])  # ".out"
LABEL = OUT.wildcard


class StreamHub:
    def __init__(self, bus: Bus, *, mode: Mode = "wildcard", submit_timeout_s: float = 5.0) -> None:
        self.bus = bus
        self.mode = mode
        self.submit_timeout_s = submit_timeout_s
        self.sinks: dict[str, Sink] = {}
        self._subs: dict[str, NatsSubscription] = {}  # per_request mode
        self._wildcard: NatsSubscription | None = None
        self._decoder = msgspec.msgpack.Decoder(StreamMsg)
        self._bad = metrics.MESSAGE_ERRORS.labels(bus.service, LABEL, "bad_request")

    async def start(self) -> None:
        if self.mode == "wildcard":
            self._wildcard = await self.bus.nc.subscribe(
                OUT.wildcard, cb=self._on_wildcard, pending_msgs_limit=self.bus.settings.pending_msgs_limit,
            )
            await self.bus.nc.flush()

    async def stop(self) -> None:
        subs = [self._wildcard, *self._subs.values()] if self._wildcard else list(self._subs.values())
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may already be closing
                pass
        self._subs.clear()
        self._wildcard = None
        self.sinks.clear()

    # --- routing chunks -------------------------------------------------------------------
    async def open(self, request_id: str, sink: Sink) -> None:
        """Start receiving `request_id`'s chunks (before submitting it)."""
        self.sinks[request_id] = sink
        if self.mode == "per_request":
            self._subs[request_id] = await self.bus.nc.subscribe(request_out(request_id), cb=self._on_message)

    async def close(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        sub = self._subs.pop(request_id, None)
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:
                pass

    async def _on_wildcard(self, raw: Msg) -> None:
        sink = self.sinks.get(raw.subject[_PREFIX_LEN:-_SUFFIX_LEN])
        if sink is not None:  # someone else's request (another gateway): not even decoded
            self._deliver(sink, raw)

    async def _on_message(self, raw: Msg) -> None:
        sink = self.sinks.get(raw.subject[_PREFIX_LEN:-_SUFFIX_LEN])
        if sink is not None:
            self._deliver(sink, raw)

    def _deliver(self, sink: Sink, raw: Msg) -> None:
        try:
            msg = self._decoder.decode(raw.data)
        except msgspec.MsgspecError as exc:
            self._bad.inc()
            log.warning("undecodable token chunk dropped", subject=raw.subject, error=str(exc))
            return
        try:
            sink(msg)
        except Exception as exc:  # a bug in a sink must not stop the subscription
            log_failure("token chunk sink failed", exc, subject=raw.subject)

    # --- commands -------------------------------------------------------------------------
    async def submit(self, request: SubmitRequest) -> SubmitReply:
        """Raises the bus errors (NoResponders, DeadlineExceeded, RemoteError, Unavailable)."""
        return await self.bus.request(dispatch_submit(), request, SubmitReply, timeout=self.submit_timeout_s)

    async def abort(self, request_id: str, reason: AbortReason) -> None:
        try:
            await self.bus.publish(request_abort(request_id), AbortRequest(
                request_id=request_id, reason=reason, ts=time.time()))
        except Exception as exc:  # the connection is gone: the worker's deadline ends the request
            log.warning("abort not published", request_id=request_id, error=repr(exc))


__all__ = ["LABEL", "Mode", "Sink", "StreamHub", "StreamMsg"]

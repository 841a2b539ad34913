"""A minimal responder on `tidal.v1.dispatch.submit` that speaks the real protocol over real NATS.

It stands where the dispatcher would, for the refusals a real dispatcher only gives under load
or while shutting down: the request's `sampling.seed` picks the answer — a typed
`SubmitRejected` with a given reason, a failure (the bus answers the typed `ErrorReply`), or
`SubmitAccepted` with nothing published afterwards, so the request stays in flight (for the
disconnect and drain tests). It generates no tokens. It records the aborts it hears.
"""
from __future__ import annotations

import asyncio
import time

from shared.bus import Bus, BusSettings, Delivery, Subscription
from shared.events.dispatch import SubmitAccepted, SubmitRejected, SubmitReply, SubmitRequest
from shared.events.stream import AbortRequest
from shared.subjects import CATALOG, dispatch_submit

REJECT = {1: "queue_full", 2: "no_capacity", 3: "draining", 4: "model_not_found", 5: "context_length_exceeded"}
FAIL = 6  # raises: the bus answers an `internal` ErrorReply
HOLD = 7  # admits and publishes nothing
SECRET = "secret detail at 10.1.2.3:4222"


class SubmitResponder:
    def __init__(self) -> None:
        self.bus: Bus | None = None
        self.subs: list[Subscription] = []
        self.submits: list[SubmitRequest] = []
        self.aborts: list[tuple[float, AbortRequest]] = []
        self.seen = asyncio.Event()

    async def start(self, nats_url: str) -> "SubmitResponder":
        self.bus = await Bus.connect(BusSettings(url=nats_url), service="dispatcher")
        self.subs.append(await self.bus.subscribe(dispatch_submit(), SubmitRequest, self._submit, queue="dispatcher"))
        self.subs.append(await self.bus.subscribe(CATALOG["request.abort"].wildcard, AbortRequest, self._abort))
        return self

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()
        if self.bus is not None:
            await self.bus.close()

    async def _submit(self, msg: SubmitRequest, _ctx: Delivery) -> SubmitReply:
        self.submits.append(msg)
        self.seen.set()
        seed = msg.sampling.seed
        if seed in REJECT:
            return SubmitRejected(request_id=msg.request_id, reason=REJECT[seed], message=SECRET,  # type: ignore[arg-type]
                                  retry_after_s=2.5)
        if seed == FAIL:
            raise RuntimeError(SECRET)
        return SubmitAccepted(request_id=msg.request_id, queue_position=1)

    async def _abort(self, msg: AbortRequest, _ctx: Delivery) -> None:
        self.aborts.append((time.time(), msg))

    async def wait_abort(self, request_id: str, timeout: float = 5.0) -> tuple[float, AbortRequest]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for seen in self.aborts:
                if seen[1].request_id == request_id:
                    return seen
            await asyncio.sleep(0.01)
        raise AssertionError(f"no abort of {request_id} within {timeout}s (aborts: {self.aborts})")


__all__ = ["FAIL", "HOLD", "REJECT", "SECRET", "SubmitResponder"]

"""Ask every instance of a service for its health (scatter-gather on `tidal.v1.<service>.health`).

Every instance of a service answers its health subject (no queue group), so one request with
a private reply inbox collects all of them; `Bus.request` would return only the first.
"""
from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors

from shared.bus import Bus
from shared.health import HealthReply, HealthRequest
from shared.subjects import health
from shared.wire import HDR_DEADLINE, HDR_ERROR, encode

_decoder = msgspec.msgpack.Decoder(HealthReply)


async def gather_health(
    bus: Bus, service: str, *, timeout: float = 0.5, expect: set[str] | None = None
) -> dict[str, HealthReply]:
    """Health replies of `service`'s instances by instance id, collected for `timeout` seconds
    (or until every instance in `expect` has answered)."""
    replies: dict[str, HealthReply] = {}
    done = asyncio.Event()
    nc = bus.nc
    inbox = nc.new_inbox()

    async def on_reply(msg: object) -> None:
        if msg.headers and HDR_ERROR in msg.headers:  # type: ignore[attr-defined]
            return
        try:
            reply = _decoder.decode(msg.data)  # type: ignore[attr-defined]
        except msgspec.MsgspecError:
            return  # not a health reply: ignore (a bad actor must not break status)
        replies[reply.instance] = reply
        if expect is not None and expect <= replies.keys():
            done.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        deadline = str(int((time.time() + timeout) * 1000))
        await nc.publish(health(service), encode(HealthRequest()), reply=inbox, headers={HDR_DEADLINE: deadline})
        try:
            await asyncio.wait_for(done.wait(), timeout)
        except asyncio.TimeoutError:
            pass
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass
    return replies

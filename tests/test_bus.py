"""The bus against a real nats-server: typed request/reply, deadlines, queue groups, headers, reconnect."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import msgspec
import pytest

from shared.actors import Actor
from shared.bus import Bus, BusSettings, Delivery, deadline_var
from shared.logging import request_id_var
from shared.metrics import sample_value
from shared.wire import (
    HDR_DEADLINE, HDR_IDEMPOTENCY_KEY, DeadlineExceeded, NoResponders, NotFound, RemoteError, Unavailable,
)


class Work(msgspec.Struct, frozen=True):
    n: int
    delay_s: float = 0.0


class Done(msgspec.Struct, frozen=True):
    n: int
    by: str = ""


class Command(msgspec.Struct, frozen=True):
    idempotency_key: str
    n: int


@pytest.fixture
async def buses(nats_url):
    """Two services' connections: `a` calls, `b` answers."""
    a = await Bus.connect(BusSettings(url=nats_url, request_timeout_s=2.0), service="alpha")
    b = await Bus.connect(BusSettings(url=nats_url, request_timeout_s=2.0), service="beta")
    yield a, b
    await a.close()
    await b.close()


async def test_typed_request_reply(buses) -> None:
    a, b = buses

    async def double(msg: Work, _ctx: Delivery) -> Done:
        return Done(n=msg.n * 2, by="beta")

    await b.subscribe("tidal.v1.test.double", Work, double)
    reply = await a.request("tidal.v1.test.double", Work(n=21), Done)
    assert reply == Done(n=42, by="beta")


async def test_deadline_expires_at_about_the_deadline_and_travels_in_a_header(buses) -> None:
    a, b = buses
    seen: list[tuple[float | None, dict[str, str] | None]] = []

    async def slow(msg: Work, ctx: Delivery) -> Done:
        seen.append((ctx.deadline, ctx.headers))
        await asyncio.sleep(msg.delay_s)
        return Done(n=msg.n)

    await b.subscribe("tidal.v1.test.slow", Work, slow)
    sent = time.time()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await a.request("tidal.v1.test.slow", Work(n=1, delay_s=1.5), Done, timeout=0.3)
    elapsed = time.monotonic() - started
    assert 0.28 <= elapsed < 0.8, elapsed
    deadline, headers = seen[0]
    assert headers is not None and HDR_DEADLINE in headers
    assert deadline is not None and abs(deadline - (sent + 0.3)) < 0.05  # the responder knows when the caller gives up
    labels = {"service": "alpha", "subject": "tidal.v1.test.slow", "code": "deadline_exceeded"}
    assert sample_value("tidal_request_errors_total", labels) >= 1


async def test_responder_skips_work_whose_caller_already_gave_up(buses) -> None:
    a, b = buses
    handled: list[int] = []

    class Serial(Actor):  # one message at a time: the second waits behind the first
        async def on_start(self) -> None:
            await self.bind("tidal.v1.test.serial", Work, self.work)

        async def work(self, msg: Work, _ctx: Delivery) -> Done:
            handled.append(msg.n)
            await asyncio.sleep(msg.delay_s)
            return Done(n=msg.n)

    actor = Serial("serial")
    await actor.start(b)
    labels = {"service": "beta", "subject": "tidal.v1.test.serial", "reason": "deadline_exceeded"}
    before = sample_value("tidal_message_errors_total", labels)
    first = asyncio.ensure_future(a.request("tidal.v1.test.serial", Work(n=1, delay_s=0.6), Done, timeout=3))
    await asyncio.sleep(0.1)
    with pytest.raises(DeadlineExceeded):
        await a.request("tidal.v1.test.serial", Work(n=2), Done, timeout=0.2)
    assert (await first).n == 1
    assert (await a.request("tidal.v1.test.serial", Work(n=3), Done)).n == 3
    assert handled == [1, 3]  # n=2 was dequeued after its deadline and never handled
    assert sample_value("tidal_message_errors_total", labels) == before + 1
    await actor.stop(1.0)


async def test_nested_request_inherits_the_remaining_deadline(buses) -> None:
    a, b = buses
    inner_deadlines: list[float | None] = []

    async def inner(_msg: Work, ctx: Delivery) -> Done:
        inner_deadlines.append(ctx.deadline)
        return Done(n=0)

    async def outer(msg: Work, ctx: Delivery) -> Done:
        assert deadline_var.get() == ctx.deadline
        await b.request("tidal.v1.test.inner", msg, Done, timeout=30.0)  # capped by the outer deadline
        return Done(n=1)

    await a.subscribe("tidal.v1.test.inner", Work, inner)
    await b.subscribe("tidal.v1.test.outer", Work, outer)
    sent = time.time()
    await a.request("tidal.v1.test.outer", Work(n=1), Done, timeout=1.0)
    assert inner_deadlines[0] is not None and inner_deadlines[0] <= sent + 1.0 + 0.01


async def test_no_responders_is_its_own_error(buses) -> None:
    a, _ = buses
    started = time.monotonic()
    with pytest.raises(NoResponders) as info:
        await a.request("tidal.v1.test.nobody", Work(n=1), Done, timeout=2.0)
    assert time.monotonic() - started < 1.0  # known at once, not after the deadline
    assert info.value.code == "unavailable"


async def test_handler_error_codes_reach_the_caller(buses) -> None:
    a, b = buses

    async def lookup(msg: Work, _ctx: Delivery) -> Done:
        raise NotFound(f"no work {msg.n}", field="n")

    await b.subscribe("tidal.v1.test.lookup", Work, lookup)
    with pytest.raises(RemoteError) as info:
        await a.request("tidal.v1.test.lookup", Work(n=7), Done)
    assert (info.value.code, info.value.field) == ("not_found", "n")
    assert "no work 7" in str(info.value)


async def test_queue_group_spreads_without_duplicates(nats_url) -> None:
    members = [await Bus.connect(BusSettings(url=nats_url), service=f"member{i}") for i in range(3)]
    sender = await Bus.connect(BusSettings(url=nats_url), service="sender")
    got: dict[str, list[int]] = {f"member{i}": [] for i in range(3)}

    def handler_for(name: str):
        async def handle(msg: Work, _ctx: Delivery) -> Done:
            got[name].append(msg.n)
            return Done(n=msg.n, by=name)
        return handle

    for i, bus in enumerate(members):
        await bus.subscribe("tidal.v1.test.pool", Work, handler_for(f"member{i}"), queue="pool")
    total = 300
    replies = await asyncio.gather(*(sender.request("tidal.v1.test.pool", Work(n=n), Done) for n in range(total)))
    assert sorted(r.n for r in replies) == list(range(total))
    everything = [n for ns in got.values() for n in ns]
    assert sorted(everything) == list(range(total))  # each message to exactly one member
    shares = Counter({name: len(ns) for name, ns in got.items()})
    assert all(count >= 30 for count in shares.values()), shares  # every member took a share
    for bus in (*members, sender):
        await bus.close()


async def test_request_id_and_idempotency_key_travel_in_headers(buses) -> None:
    a, b = buses
    seen: list[Delivery] = []

    async def record(_msg: Command, ctx: Delivery) -> Done:
        seen.append(ctx)
        return Done(n=0)

    await b.subscribe("tidal.v1.test.cmd", Command, record)
    token = request_id_var.set("req-123")
    try:
        await a.request("tidal.v1.test.cmd", Command(idempotency_key="idem-9", n=1), Done)
    finally:
        request_id_var.reset(token)
    await a.request("tidal.v1.test.cmd", Command(idempotency_key="idem-9", n=1), Done, idempotency_key="explicit")
    assert (seen[0].request_id, seen[0].idempotency_key) == ("req-123", "idem-9")
    assert seen[1].headers is not None and seen[1].headers[HDR_IDEMPOTENCY_KEY] == "explicit"
    assert seen[1].request_id is None


async def test_publish_subscribe_and_events_need_no_headers(buses) -> None:
    a, b = buses
    got: asyncio.Queue[tuple[Work, Delivery]] = asyncio.Queue()

    async def on_event(msg: Work, ctx: Delivery) -> None:
        got.put_nowait((msg, ctx))

    await b.subscribe("tidal.v1.test.evt", Work, on_event)
    await a.publish("tidal.v1.test.evt", Work(n=5))
    msg, ctx = await asyncio.wait_for(got.get(), 2)
    assert msg == Work(n=5)
    assert ctx.headers is None and not ctx.expects_reply  # the fast path: nothing but the payload


async def test_reconnects_after_nats_restarts(nats_server) -> None:
    a = await Bus.connect(BusSettings(url=nats_server.url, reconnect_wait_s=0.05), service="alpha")
    b = await Bus.connect(BusSettings(url=nats_server.url, reconnect_wait_s=0.05), service="beta")

    async def echo(msg: Work, _ctx: Delivery) -> Done:
        return Done(n=msg.n)

    await b.subscribe("tidal.v1.test.echo", Work, echo)
    assert (await a.request("tidal.v1.test.echo", Work(n=1), Done)).n == 1
    nats_server.restart()
    deadline = time.monotonic() + 10
    while True:  # both sides reconnect on their own and the subscription is replayed
        try:
            assert (await a.request("tidal.v1.test.echo", Work(n=2), Done, timeout=0.5)).n == 2
            break
        except (NoResponders, DeadlineExceeded, Unavailable):
            assert time.monotonic() < deadline, "no reconnect within 10 s"
            await asyncio.sleep(0.1)
    assert sample_value("tidal_bus_connection_events_total", {"service": "alpha", "event": "reconnected"}) >= 1
    await a.close()
    await b.close()


async def test_connect_to_nothing_fails_clearly() -> None:
    with pytest.raises(Unavailable) as info:
        await Bus.connect(BusSettings(url="nats://127.0.0.1:1", initial_connect_s=0.5, connect_timeout_s=0.2))
    assert "nats://127.0.0.1:1" in str(info.value)

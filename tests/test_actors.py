"""The actor runtime against a real nats-server: bad input, crashes, mailbox rules, supervision, drain."""
from __future__ import annotations

import asyncio
import io
import json
from typing import Union

import msgspec
import pytest

from shared.actors import ESCALATE, Actor, RestartPolicy
from shared.bus import Bus, BusSettings, Delivery
from shared.logging import configure_logging
from shared.metrics import sample_value
from shared.wire import HDR_ERROR, ErrorReply, NoResponders, RemoteError, decode_error_reply


class Add(msgspec.Struct, frozen=True, tag="add", tag_field="type"):
    n: int


class Reset(msgspec.Struct, frozen=True, tag="reset", tag_field="type"):
    pass


CounterCommand = Union[Add, Reset]


class Total(msgspec.Struct, frozen=True):
    total: int


class Sleep(msgspec.Struct, frozen=True):
    seconds: float
    n: int = 0


class CounterActor(Actor):
    """Owns `total`; `boom` raises to exercise the crash path."""

    def __init__(self) -> None:
        super().__init__("counter")
        self.total = 0

    async def on_start(self) -> None:
        await self.bind("tidal.v1.test.counter", CounterCommand, self.command)
        await self.bind("tidal.v1.test.boom", Add, self.boom)

    async def command(self, msg: CounterCommand, _ctx: Delivery) -> Total:
        if isinstance(msg, Add):
            self.total += msg.n
        else:
            self.total = 0
        return Total(total=self.total)

    async def boom(self, _msg: Add, _ctx: Delivery) -> Total:
        raise RuntimeError("secret internal detail")


@pytest.fixture
async def buses(nats_url):
    a = await Bus.connect(BusSettings(url=nats_url), service="caller")
    b = await Bus.connect(BusSettings(url=nats_url), service="actors")
    yield a, b
    await a.close()
    await b.close()


async def raw_request(bus: Bus, subject: str, data: bytes) -> tuple[bool, bytes]:
    msg = await bus.nc.request(subject, data, timeout=2)
    return bool(msg.headers and HDR_ERROR in msg.headers), msg.data


async def test_malformed_payloads_get_typed_errors_and_the_actor_keeps_serving(buses) -> None:
    a, b = buses
    actor = CounterActor()
    await actor.start(b)
    subject = "tidal.v1.test.counter"
    labels = {"service": "actors", "subject": subject}
    before = {r: sample_value("tidal_message_errors_total", {**labels, "reason": r}) for r in ("bad_request", "unknown_message")}
    cases = [
        (b"\xc1\xc1garbage", "bad_request", None),
        (msgspec.msgpack.encode({"type": "add", "n": "seven"}), "bad_request", "n"),
        (msgspec.msgpack.encode({"type": "multiply", "n": 2}), "unknown_message", "type"),
    ]
    for data, code, field in cases:
        is_error, payload = await raw_request(a, subject, data)
        assert is_error
        reply = decode_error_reply(payload)
        assert (reply.code, reply.field) == (code, field), reply
        # the next good message is served as if nothing happened
        assert await a.request(subject, Add(n=1), Total) == Total(total=actor.total)
    assert actor.total == 3
    assert sample_value("tidal_message_errors_total", {**labels, "reason": "bad_request"}) == before["bad_request"] + 2
    assert sample_value("tidal_message_errors_total", {**labels, "reason": "unknown_message"}) == before["unknown_message"] + 1
    await actor.stop(1.0)


async def test_handler_crash_is_an_internal_error_without_traceback_and_is_logged(buses) -> None:
    a, b = buses
    log = io.StringIO()
    configure_logging("actors", level="info", stream=log)
    actor = CounterActor()
    await actor.start(b)
    try:
        with pytest.raises(RemoteError) as info:
            await a.request("tidal.v1.test.boom", Add(n=1), Total)
        assert info.value.code == "internal"
        assert "secret internal detail" not in str(info.value)  # details stay in the log
        assert await a.request("tidal.v1.test.counter", Add(n=5), Total) == Total(total=5)
        records = [json.loads(line) for line in log.getvalue().splitlines() if line.startswith("{")]
        crash = [r for r in records if r.get("event") == "handler failed"]
        assert crash and "secret internal detail" in json.dumps(crash[0]["exception"])
        labels = {"service": "actors", "subject": "tidal.v1.test.boom", "reason": "internal"}
        assert sample_value("tidal_message_errors_total", labels) >= 1
    finally:
        await actor.stop(1.0)
        configure_logging("test", level="info")


class Recorder(Actor):
    """Tracks how many handlers run at once, across two subscriptions."""

    def __init__(self, concurrency: int) -> None:
        super().__init__("recorder", concurrency=concurrency)
        self.running = 0
        self.peak = 0
        self.done: list[int] = []

    async def on_start(self) -> None:
        await self.bind("tidal.v1.test.rec.a", Sleep, self.sleep)
        await self.bind("tidal.v1.test.rec.b", Sleep, self.sleep)

    async def sleep(self, msg: Sleep, _ctx: Delivery) -> Total:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(msg.seconds)
        self.running -= 1
        self.done.append(msg.n)
        return Total(total=msg.n)


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_mailbox_runs_at_most_the_declared_concurrency(buses, concurrency: int) -> None:
    a, b = buses
    actor = Recorder(concurrency)
    await actor.start(b)
    calls = [
        a.request(f"tidal.v1.test.rec.{'ab'[i % 2]}", Sleep(seconds=0.1, n=i), Total, timeout=5) for i in range(6)
    ]
    results = await asyncio.gather(*calls)
    assert sorted(r.total for r in results) == list(range(6))
    assert actor.peak == concurrency
    await actor.stop(1.0)


async def test_turn_is_exclusive_with_handlers(buses) -> None:
    a, b = buses
    actor = Recorder(1)
    await actor.start(b)
    pending = asyncio.ensure_future(a.request("tidal.v1.test.rec.a", Sleep(seconds=0.3, n=1), Total))
    await asyncio.sleep(0.1)
    async with actor.turn():
        assert actor.running == 0 and actor.done == [1]  # we got our turn only after the handler finished
    await pending
    await actor.stop(1.0)


async def test_crashed_task_is_restarted_with_backoff_and_escalates_per_policy(buses) -> None:
    _, b = buses
    runs: list[str] = []
    escalated: list[tuple[str, str]] = []

    class Flaky(Actor):
        async def on_start(self) -> None:
            self.spawn("flaky", self.flaky, policy=RestartPolicy(initial_backoff_s=0.01))
            self.spawn("fatal", self.fatal, policy=ESCALATE)

        async def flaky(self) -> None:
            runs.append("flaky")
            if len(runs) < 3:
                raise ValueError("transient")
            await asyncio.sleep(3600)

        async def fatal(self) -> None:
            raise RuntimeError("unrecoverable")

    actor = Flaky("flaky-actor")
    await actor.start(b, on_escalate=lambda act, task, exc: escalated.append((task, str(exc))))
    for _ in range(100):
        if len(runs) >= 3 and escalated:
            break
        await asyncio.sleep(0.02)
    assert runs == ["flaky", "flaky", "flaky"]  # restarted twice, then it stayed up
    assert escalated == [("fatal", "unrecoverable")]
    assert sample_value("tidal_task_restarts_total", {"service": "actors", "actor": "flaky-actor", "task": "flaky"}) == 2
    await actor.stop(1.0)


async def test_too_many_crashes_in_the_window_escalate(buses) -> None:
    _, b = buses
    escalated: list[str] = []

    class Crashy(Actor):
        async def on_start(self) -> None:
            self.spawn("loop", self.crash, policy=RestartPolicy(initial_backoff_s=0.001, max_restarts=2, window_s=60))

        async def crash(self) -> None:
            raise OSError("always")

    actor = Crashy("crashy")
    await actor.start(b, on_escalate=lambda act, task, exc: escalated.append(task))
    for _ in range(100):
        if escalated:
            break
        await asyncio.sleep(0.02)
    assert escalated == ["loop"]
    await actor.stop(1.0)


async def test_drain_finishes_in_flight_work_then_refuses_new_work(buses) -> None:
    a, b = buses
    actor = Recorder(4)
    await actor.start(b)
    in_flight = [
        asyncio.ensure_future(a.request("tidal.v1.test.rec.a", Sleep(seconds=0.4, n=i), Total, timeout=5)) for i in range(4)
    ]
    await asyncio.sleep(0.15)
    assert actor.inflight == 4
    clean = await actor.stop(timeout_s=3.0)
    assert clean
    assert sorted((await asyncio.gather(*in_flight)), key=lambda t: t.total) == [Total(total=i) for i in range(4)]
    with pytest.raises(NoResponders):
        await a.request("tidal.v1.test.rec.a", Sleep(seconds=0, n=9), Total, timeout=1)


async def test_drain_deadline_abandons_work_that_does_not_finish(buses) -> None:
    a, b = buses
    actor = Recorder(1)
    await actor.start(b)
    stuck = asyncio.ensure_future(a.request("tidal.v1.test.rec.a", Sleep(seconds=30, n=1), Total, timeout=5))
    await asyncio.sleep(0.1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await actor.stop(timeout_s=0.3) is False
    assert loop.time() - started < 1.5
    stuck.cancel()


async def test_error_reply_is_a_struct_on_the_wire(buses) -> None:
    a, b = buses
    actor = CounterActor()
    await actor.start(b)
    is_error, payload = await raw_request(a, "tidal.v1.test.counter", b"")
    assert is_error and isinstance(msgspec.msgpack.decode(payload, type=ErrorReply), ErrorReply)
    await actor.stop(1.0)

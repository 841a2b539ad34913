"""Trace propagation across two services through NATS headers, checked with in-memory exporters."""
from __future__ import annotations

import asyncio
import io
import json

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from shared.bus import Bus, BusSettings, Delivery
from shared.logging import configure_logging, get_logger, traceparent_var
from shared.tracing import setup_tracing
from shared.wire import HDR_DEADLINE, HDR_TRACEPARENT


class Ask(msgspec.Struct, frozen=True):
    q: str


class Answer(msgspec.Struct, frozen=True):
    a: str


class Note(msgspec.Struct, frozen=True):
    text: str


async def test_span_in_service_a_is_parent_of_span_in_service_b(nats_url) -> None:
    exporter = InMemorySpanExporter()
    tracing_a = setup_tracing("svc-a", exporter=exporter)
    tracing_b = setup_tracing("svc-b", exporter=exporter)
    a = await Bus.connect(BusSettings(url=nats_url), service="svc-a", tracing=tracing_a)
    b = await Bus.connect(BusSettings(url=nats_url), service="svc-b", tracing=tracing_b)
    log_stream = io.StringIO()
    configure_logging("svc-b", stream=log_stream)
    log = get_logger("test")

    async def answer(msg: Ask, _ctx: Delivery) -> Answer:
        log.info("answering")  # must carry the trace id of the caller's trace
        await b.publish("tidal.v1.test.trace.note", Note(text=msg.q))  # a third hop: B -> C
        return Answer(a=msg.q.upper())

    notes: list[Delivery] = []

    async def on_note(_msg: Note, ctx: Delivery) -> None:
        notes.append(ctx)

    await b.subscribe("tidal.v1.test.trace.ask", Ask, answer)
    await a.subscribe("tidal.v1.test.trace.note", Note, on_note)
    try:
        with tracing_a.tracer.start_as_current_span("client operation") as root:
            assert await a.request("tidal.v1.test.trace.ask", Ask(q="hi"), Answer) == Answer(a="HI")
        await a.nc.flush()
        for _ in range(50):
            if len(exporter.get_finished_spans()) >= 5:
                break
            await asyncio.sleep(0.02)
    finally:
        configure_logging("test")
        await a.close()
        await b.close()
    spans = {(s.name, s.kind): s for s in exporter.get_finished_spans()}
    client = spans[("tidal.v1.test.trace.ask request", SpanKind.CLIENT)]
    server = spans[("tidal.v1.test.trace.ask process", SpanKind.SERVER)]
    producer = spans[("tidal.v1.test.trace.note publish", SpanKind.PRODUCER)]
    consumer = spans[("tidal.v1.test.trace.note process", SpanKind.CONSUMER)]
    trace_id = root.get_span_context().trace_id
    assert {s.context.trace_id for s in (client, server, producer, consumer)} == {trace_id}
    assert client.parent.span_id == root.get_span_context().span_id
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote  # A's span is B's parent
    assert producer.parent.span_id == server.context.span_id
    assert consumer.parent.span_id == producer.context.span_id
    assert server.resource.attributes["service.name"] == "svc-b"
    assert client.resource.attributes["service.name"] == "svc-a"
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines() if '"answering"' in line]
    assert lines and lines[0]["trace_id"] == format(trace_id, "032x")
    assert notes[0].headers is not None and notes[0].headers[HDR_TRACEPARENT].split("-")[1] == format(trace_id, "032x")


async def test_with_tracing_off_no_span_is_built_and_traceparent_passes_through(nats_url) -> None:
    a = await Bus.connect(BusSettings(url=nats_url), service="plain-a")
    b = await Bus.connect(BusSettings(url=nats_url), service="plain-b")
    seen: list[Delivery] = []
    forwarded: list[Delivery] = []

    async def hop(msg: Ask, ctx: Delivery) -> Answer:
        seen.append(ctx)
        await b.publish("tidal.v1.test.trace.fwd", Note(text=msg.q))
        return Answer(a="ok")

    async def on_fwd(_msg: Note, ctx: Delivery) -> None:
        forwarded.append(ctx)

    await b.subscribe("tidal.v1.test.trace.hop", Ask, hop)
    await a.subscribe("tidal.v1.test.trace.fwd", Note, on_fwd)
    await a.request("tidal.v1.test.trace.hop", Ask(q="x"), Answer)  # no trace anywhere: only the deadline header
    assert set(seen[0].headers or {}) == {HDR_DEADLINE}
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    token = traceparent_var.set(parent)  # as if an upstream traced service had called us
    try:
        await a.request("tidal.v1.test.trace.hop", Ask(q="y"), Answer)
    finally:
        traceparent_var.reset(token)
    await a.nc.flush()
    for _ in range(50):
        if len(forwarded) >= 2:
            break
        await asyncio.sleep(0.02)
    assert seen[1].headers[HDR_TRACEPARENT] == parent
    # the trace survives a hop through an untraced service
    assert forwarded[1].headers is not None and forwarded[1].headers[HDR_TRACEPARENT] == parent
    assert not trace.get_current_span().get_span_context().is_valid
    await a.close()
    await b.close()


def test_tracing_mode_selection(monkeypatch) -> None:
    monkeypatch.delenv("TIDAL_TRACING", raising=False)
    assert setup_tracing("svc") is None  # off by default
    assert setup_tracing("svc", "off") is None
    console = setup_tracing("svc", "console")
    assert console is not None
    console.shutdown()
    monkeypatch.setenv("TIDAL_TRACING", "bogus")
    with pytest.raises(ValueError) as info:
        setup_tracing("svc")
    assert "TIDAL_TRACING" in str(info.value) and "bogus" in str(info.value)

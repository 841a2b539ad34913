"""HTTP SERVER spans: the gateway's ASGI app (the real Litestar stack, in-process over httpx's ASGI
transport) on a real NATS, with a dispatcher stand-in on its own traced bus that admits the submit
and publishes the final chunk. In-memory exporters, as in tests/test_tracing.py."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from services.gateway.app import build_app
from services.gateway.catalog import ModelCatalog
from services.gateway.hub import StreamHub
from services.gateway.state import GatewayState
from shared.bus import Bus, BusSettings, Delivery
from shared.config import parse_config
from shared.events.common import Usage
from shared.events.dispatch import SubmitAccepted, SubmitRequest
from shared.events.registry import Bucket, CatalogChanged, ModelRecord
from shared.events.stream import TokenChunk
from shared.subjects import dispatch_submit, request_out
from shared.tracing import REQUEST_ID_ATTRIBUTE, Tracing, setup_tracing

MODEL = "span-model"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


class Traced:
    """A gateway app and a dispatcher stand-in, each on its own bus, spans into one exporter."""

    def __init__(self, exporter: InMemorySpanExporter, gateway_bus: Bus, dispatcher_bus: Bus, app: object,
                 api_key: str | None) -> None:
        self.exporter = exporter
        self.gateway_bus = gateway_bus
        self.dispatcher_bus = dispatcher_bus
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        self.http = httpx.AsyncClient(transport=transport, base_url="http://gateway",
                                      headers={"authorization": f"Bearer {api_key}"} if api_key else None)

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    async def wait_spans(self, count: int) -> list[ReadableSpan]:
        deadline = time.monotonic() + 5
        while len(self.spans()) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.spans()


async def _admit_and_finish(bus: Bus, msg: SubmitRequest, _ctx: Delivery) -> SubmitAccepted:
    # as a dispatcher + worker would: the final chunk goes out while the submit is handled
    await bus.publish(request_out(msg.request_id), TokenChunk(
        request_id=msg.request_id, seq=0, token_ids=[5], text="x", finish_reason="length",
        usage=Usage(prompt_tokens=len(msg.prompt_token_ids), completion_tokens=1)))
    return SubmitAccepted(request_id=msg.request_id, queue_position=0)


@asynccontextmanager
async def _traced(nats_url: str, tokenizer_dir: Path, *, tracing: bool, api_key: str | None = None
                  ) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    gw_tracing: Tracing | None = setup_tracing("gateway", exporter=exporter) if tracing else None
    gateway_bus = await Bus.connect(BusSettings(url=nats_url), service="gateway", tracing=gw_tracing)
    dispatcher_bus = await Bus.connect(BusSettings(url=nats_url), service="dispatcher",
                                       tracing=setup_tracing("dispatcher", exporter=exporter))
    await dispatcher_bus.subscribe(dispatch_submit(), SubmitRequest,
                                   lambda msg, ctx: _admit_and_finish(dispatcher_bus, msg, ctx), queue="dispatcher")
    keys = f'api_keys = ["{api_key}"]' if api_key else ""
    config = parse_config(f"[gateway]\n{keys}\n")
    catalog = ModelCatalog()
    catalog.views[Bucket.MODELS].apply(CatalogChanged(
        bucket=Bucket.MODELS, key=MODEL, revision=1, op="put", ts=time.time(),
        record=ModelRecord(name=MODEL, path=str(tokenizer_dir), num_layers=1, max_context=128)))
    catalog.loaded.set()
    state = GatewayState(config, catalog, is_draining=lambda: False)
    hub = StreamHub(gateway_bus)
    await hub.start()
    state.hub = hub
    traced = Traced(exporter, gateway_bus, dispatcher_bus, build_app(state), api_key)
    try:
        yield traced
    finally:
        await traced.http.aclose()
        await hub.stop()
        await gateway_bus.close()
        await dispatcher_bus.close()


@pytest.fixture
async def traced(nats_url: str, tokenizer_dir: Path) -> AsyncIterator[Traced]:
    async with _traced(nats_url, tokenizer_dir, tracing=True) as t:
        yield t


def _one(spans: list[ReadableSpan], name: str, kind: SpanKind) -> ReadableSpan:
    found = [s for s in spans if s.name == name and s.kind == kind]
    assert len(found) == 1, [(s.name, s.kind) for s in spans]
    return found[0]


async def test_the_http_span_parents_the_nats_spans_of_the_request(traced: Traced) -> None:
    resp = await traced.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1},
                                  headers={"traceparent": f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"})
    assert resp.status_code == 200, resp.text
    spans = await traced.wait_spans(4)
    http = _one(spans, "POST /v1/completions", SpanKind.SERVER)
    client = _one(spans, "tidal.v1.dispatch.submit request", SpanKind.CLIENT)
    server = _one(spans, "tidal.v1.dispatch.submit process", SpanKind.SERVER)
    chunk = next(s for s in spans if s.kind == SpanKind.PRODUCER and s.name.endswith(".out publish"))
    assert format(http.context.trace_id, "032x") == CLIENT_TRACE  # the HTTP client's trace, continued
    assert http.parent is not None and http.parent.is_remote
    assert format(http.parent.span_id, "016x") == "b7ad6b7169203331"
    assert {s.context.trace_id for s in (http, client, server, chunk)} == {http.context.trace_id}
    assert client.parent.span_id == http.context.span_id  # the submit is made inside the HTTP request
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote  # across NATS
    assert chunk.parent.span_id == server.context.span_id
    attrs = http.attributes
    assert attrs["http.route"] == "/v1/completions" and attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 200
    assert str(attrs[REQUEST_ID_ATTRIBUTE]).startswith("cmpl-") and resp.json()["id"] == attrs[REQUEST_ID_ATTRIBUTE]
    assert http.resource.attributes["service.name"] == "gateway"
    assert server.resource.attributes["service.name"] == "dispatcher"
    assert http.status.status_code is StatusCode.UNSET


async def test_refused_and_unknown_requests_get_spans_with_their_status(traced: Traced) -> None:
    assert (await traced.http.post("/v1/completions", json={"model": "nope", "prompt": "x"})).status_code == 404
    assert (await traced.http.get("/no/such/path")).status_code == 404
    assert (await traced.http.get("/v1/models")).status_code == 200
    spans = await traced.wait_spans(3)
    unknown_model = _one(spans, "POST /v1/completions", SpanKind.SERVER)
    unknown_path = _one(spans, "GET", SpanKind.SERVER)  # no route matched: the method alone names it
    models = _one(spans, "GET /v1/models", SpanKind.SERVER)
    assert unknown_model.attributes["http.response.status_code"] == 404
    assert unknown_path.attributes["http.response.status_code"] == 404 and "http.route" not in unknown_path.attributes
    assert unknown_path.attributes["url.path"] == "/no/such/path"
    assert models.attributes["http.response.status_code"] == 200
    assert not [s for s in spans if s.kind == SpanKind.CLIENT]  # refused before any NATS request
    assert len({s.context.trace_id for s in spans}) == 3  # one trace per request


async def test_a_refusal_at_the_front_door_is_traced_too(nats_url: str, tokenizer_dir: Path) -> None:
    async with _traced(nats_url, tokenizer_dir, tracing=True, api_key="sk-span-test-key") as traced:
        traced.http.headers.pop("authorization")
        assert (await traced.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).status_code == 401
        (span,) = await traced.wait_spans(1)
        assert span.name == "POST /v1/completions" and span.attributes["http.response.status_code"] == 401


async def test_without_tracing_no_http_span_is_made(nats_url: str, tokenizer_dir: Path) -> None:
    async with _traced(nats_url, tokenizer_dir, tracing=False) as traced:
        resp = await traced.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 1})
        assert resp.status_code == 200
        spans = await traced.wait_spans(2)
        assert {s.resource.attributes["service.name"] for s in spans} == {"dispatcher"}  # only the traced peer's
        server = _one(spans, "tidal.v1.dispatch.submit process", SpanKind.SERVER)
        assert server.parent is None  # nothing upstream was traced

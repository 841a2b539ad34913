"""OpenTelemetry tracing across services through NATS headers (W3C `traceparent`/`tracestate`).

Off by default. `TIDAL_TRACING=console|otlp|off` selects the exporter; `otlp` needs the
optional `opentelemetry-exporter-otlp` package (not a hard dependency of Tidal) and honours
the standard `OTEL_EXPORTER_OTLP_*` variables.

`setup_tracing()` returns a `Tracing` (or None when off) that is handed to the `Bus`:
with one, every publish/request starts a PRODUCER/CLIENT span and injects its context into
the headers, and every received message starts a CONSUMER/SERVER span whose parent is the
sender's span. With None, the bus builds no span and parses no header beyond forwarding an
incoming `traceparent` unchanged (so a trace survives a hop through an untraced service).

The gateway adds a SERVER span per HTTP request (`http_server_span`, OpenTelemetry's HTTP
conventions: `http.request.method`, `http.route`, `http.response.status_code`, and
`tidal.request_id` once a generation has one); the NATS spans of the work it causes are its
children, so one trace runs HTTP → gateway → dispatcher → worker. A `traceparent` header sent by
the HTTP client is honoured (the request joins the client's trace).

Tests pass their own exporter: `setup_tracing("svc", exporter=InMemorySpanExporter())`.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping, MutableMapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACING_ENV = "TIDAL_TRACING"
TRACING_MODES = ("off", "console", "otlp")

_propagator = TraceContextTextMapPropagator()

# re-exported for the bus
PRODUCER = SpanKind.PRODUCER
CONSUMER = SpanKind.CONSUMER
CLIENT = SpanKind.CLIENT
SERVER = SpanKind.SERVER


@dataclass
class Tracing:
    """A tracer provider for one service (or one bus, in tests) and its tracer."""

    provider: TracerProvider
    tracer: trace.Tracer

    def shutdown(self) -> None:
        """Flush and stop the exporters (call once at service exit)."""
        self.provider.shutdown()


def _otlp_exporter() -> SpanExporter:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # type: ignore[no-redef]
        except ImportError as exc:
            raise RuntimeError(
                f"{TRACING_ENV}=otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp"
            ) from exc
    return OTLPSpanExporter()


def setup_tracing(
    service: str,
    mode: str | None = None,
    *,
    instance: str | None = None,
    exporter: SpanExporter | None = None,
    set_global: bool = False,
) -> Tracing | None:
    """Build tracing for `service`; None when off.

    `mode` defaults to $TIDAL_TRACING (default "off"). An explicit `exporter` (tests) turns
    tracing on with synchronous export regardless of `mode`. `set_global` also installs the
    provider as OpenTelemetry's global one (the service runtime does, once per process).
    """
    if exporter is None:
        mode = (mode or os.environ.get(TRACING_ENV) or "off").strip().lower()
        if mode not in TRACING_MODES:
            raise ValueError(f"{TRACING_ENV}: expected one of {', '.join(TRACING_MODES)}, got {mode!r}")
        if mode == "off":
            return None
        exporter = ConsoleSpanExporter() if mode == "console" else _otlp_exporter()
        processor = BatchSpanProcessor(exporter)
    else:
        processor = SimpleSpanProcessor(exporter)
    attributes = {"service.name": service}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(processor)
    if set_global:
        trace.set_tracer_provider(provider)
    return Tracing(provider=provider, tracer=provider.get_tracer("tidal.bus"))


def inject(headers: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write the current (or given) span context into `headers` as traceparent/tracestate."""
    _propagator.inject(headers, context=context)


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The remote parent context carried by `headers`, or None when there is none."""
    if not headers or "traceparent" not in headers:
        return None
    return _propagator.extract(headers)


# --- HTTP (the gateway) ------------------------------------------------------------------------
REQUEST_ID_ATTRIBUTE = "tidal.request_id"


@contextmanager
def http_server_span(tracing: Tracing, method: str, route: str | None, path: str,
                     headers: Mapping[str, str] | None = None) -> Iterator[Span]:
    """The SERVER span of one HTTP request, current while it is handled (`route`: the matched
    route template, None when no route matched). Set the status with `end_http_span`."""
    attributes = {"http.request.method": method, "url.path": path[:256]}
    if route is not None:
        attributes["http.route"] = route
    with tracing.tracer.start_as_current_span(
        f"{method} {route}" if route is not None else method, context=extract(headers), kind=SERVER,
        attributes=attributes,
    ) as span:
        yield span


def end_http_span(span: Span, status: int) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:  # OpenTelemetry's HTTP conventions: 4xx is the client's error, not the server's
        span.set_status(Status(StatusCode.ERROR))


def annotate_request(request_id: str) -> None:
    """Name the request on the current span (the HTTP one while a handler runs); no-op untraced."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(REQUEST_ID_ATTRIBUTE, request_id)

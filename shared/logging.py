"""structlog JSON logs to stderr, with `request_id` and `trace_id` bound from context.

The bus runtime sets `request_id_var` and `traceparent_var` (contextvars) around every
handler, so every log line emitted while handling a message carries the request id and trace
id without the handler passing them around. Reading them happens only when a line is
actually logged, so the hot path pays two contextvar sets, not a structlog bind.

Usage::

    from shared.logging import configure_logging, get_logger
    configure_logging("dispatcher", level="info", instance="dispatcher-1")
    log = get_logger(__name__)
    log.info("admitted", model="llama")   # {"event": "admitted", "request_id": ..., ...}
"""
from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from typing import Any, TextIO

import structlog
from opentelemetry import trace

# The client request being served (from the `tidal-request-id` header, or bound at ingress).
request_id_var: ContextVar[str | None] = ContextVar("tidal_request_id", default=None)
# The incoming W3C traceparent, forwarded as-is when tracing is off so traces are not broken.
traceparent_var: ContextVar[str | None] = ContextVar("tidal_traceparent", default=None)

_service_fields: dict[str, str] = {}


# Tracebacks as JSON, without frame locals: a local may hold a request's API key or
# prompt, and logs must never carry them (structlog's dict_tracebacks shows locals).
_TRACEBACKS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)

def current_trace_id() -> str | None:
    """The trace id of the active span, else of the incoming traceparent, else None."""
    span_trace = _active_span_trace_id()
    if span_trace is not None:
        return span_trace
    parent = traceparent_var.get()
    if parent is not None and len(parent) >= 35:
        return parent[3:35]  # "00-<32 hex trace id>-<16 hex span id>-<2 hex flags>"
    return None


def _active_span_trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        return format(ctx.trace_id, "032x")
    return None


def _add_context(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in _service_fields.items():
        event.setdefault(key, value)
    request_id = request_id_var.get()
    if request_id is not None:
        event.setdefault("request_id", request_id)
    trace_id = current_trace_id()
    if trace_id is not None:
        event.setdefault("trace_id", trace_id)
    return event


def configure_logging(
    service: str | None = None,
    *,
    level: str = "info",
    instance: str | None = None,
    stream: TextIO | None = None,
) -> None:
    """Configure structlog (and stdlib logging, e.g. nats-py's) to write JSON lines to stderr."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level: expected one of debug/info/warning/error/critical, got {level!r}")
    _service_fields.clear()
    if service:
        _service_fields["service"] = service
    if instance:
        _service_fields["instance"] = instance
    out = stream or sys.stderr
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_context,
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            _TRACEBACKS,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,  # tests reconfigure; the lookup cost is per logger call site
    )
    # Libraries that use stdlib logging (nats-py, asyncio) render through the same pipeline.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                _TRACEBACKS,
                structlog.processors.JSONRenderer(),
            ],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_tidal", False):
            root.removeHandler(old)
    handler._tidal = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric)


def get_logger(name: str | None = None, **bound: Any) -> Any:
    """A structlog logger; `name` becomes the `component` field. Safe to call at import time
    (the logger is resolved lazily, after `configure_logging`)."""
    if name is not None:
        bound.setdefault("component", name)
    return structlog.get_logger(**bound)

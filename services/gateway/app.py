"""The gateway's ASGI application: Litestar routes behind the `Edge` middleware (streaming generations
take the `FastPath` past Litestar).

    state = GatewayState(config, catalog, is_draining=...)
    asgi = build_app(state)          # what uvicorn serves
    openapi_document(config)         # the OpenAPI document, no server needed
"""
from __future__ import annotations

from typing import Any

from litestar import Litestar
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme

from services.gateway.chat import create_chat_completion
from services.gateway.completions import create_completion
from services.gateway.edge import ASGIApp, Edge
from services.gateway.errors import handle_exception
from services.gateway.fast_path import FastPath
from services.gateway.http_spans import HttpSpans
from services.gateway.routes_adapters import load_lora_adapter, unload_lora_adapter
from services.gateway.routes_misc import health, list_models, openapi_json, prometheus_metrics, ready
from services.gateway.routes_tokenize import detokenize, tokenize, version
from services.gateway.state import GatewayState
from shared.config import ClusterConfig

DESCRIPTION = """OpenAI-compatible API of a Tidal cluster: completions and chat completions (streaming
and not) over every model and LoRA adapter the cluster serves. Errors are
`{"error": {"message", "type", "param", "code"}}`; see docs/api.md."""


def build_litestar(state: GatewayState) -> Litestar:
    openapi = OpenAPIConfig(
        title="Tidal gateway", version="1", description=DESCRIPTION, render_plugins=[], path="/openapi",
        components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
        security=[{"bearer": []}] if state.api_keys.required else None,
        use_handler_docstrings=False, create_examples=False,
    )
    return Litestar(
        route_handlers=[create_completion, create_chat_completion, list_models, health, ready, prometheus_metrics,
                        openapi_json, load_lora_adapter, unload_lora_adapter, tokenize, detokenize, version],
        exception_handlers={Exception: handle_exception},
        openapi_config=openapi,
        state=State({"gateway": state}),
        logging_config=None,
        debug=False,
        request_max_body_size=state.max_body_bytes,  # the Edge enforces it first; this is a backstop
    )


def build_app(state: GatewayState) -> ASGIApp:
    edge = Edge(FastPath(build_litestar(state), state), state)  # type: ignore[arg-type]
    return HttpSpans(edge, lambda: state.hub.bus.tracing if state.hub is not None else None)


def openapi_document(config: ClusterConfig) -> dict[str, Any]:
    """The OpenAPI document a gateway with this config serves at /openapi.json (no server needed)."""
    from services.gateway.catalog import ModelCatalog

    state = GatewayState(config, ModelCatalog(), is_draining=lambda: False)
    return build_litestar(state).openapi_schema.to_schema()


__all__ = ["build_app", "build_litestar", "openapi_document"]

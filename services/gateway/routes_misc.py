"""`/health`, `/ready`, `/metrics`, `/v1/models` and `/openapi.json`."""
from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, get
from litestar.openapi import ResponseSpec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.gateway.api_common import AdapterResidencyCard, HealthBody, ModelCard, ModelList
from services.gateway.errors import ApiError
from services.gateway.openapi import ApiOperation, errors
from services.gateway.state import GatewayState
from services.gateway.streaming import encoder
from shared.metrics import REGISTRY

_JSON = "application/json"


def _state(request: Request[Any, Any, Any]) -> GatewayState:
    return request.app.state.gateway  # type: ignore[no-any-return]


@get("/health", summary="Liveness", tags=["operations"], responses={
    200: ResponseSpec(HealthBody, description="The process is alive (also while draining)", generate_examples=False)})
async def health(request: Request[Any, Any, Any]) -> Response[bytes]:
    status = "draining" if _state(request).draining else "ok"
    return Response(encoder.encode(HealthBody(status=status)), media_type=_JSON)


@get("/ready", summary="Readiness", tags=["operations"], responses={
    200: ResponseSpec(HealthBody, description="Ready: a worker serves a model", generate_examples=False),
    503: ResponseSpec(HealthBody, description="Draining, starting, or no worker serves anything",
                      generate_examples=False)})
async def ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    ok, detail = state.ready()
    status = "ready" if ok else ("draining" if state.draining else "not_ready")
    return Response(encoder.encode(HealthBody(status=status, detail=detail)), status_code=200 if ok else 503,
                    media_type=_JSON, headers=None if ok else {"retry-after": "1"})


@get("/metrics", summary="Prometheus metrics", tags=["operations"], media_type="text/plain", responses={
    200: ResponseSpec(str, description="Prometheus text exposition format", media_type="text/plain",
                      generate_examples=False), **errors(401)})
async def prometheus_metrics() -> Response[bytes]:
    # litestar appends "; charset=utf-8" to a text/* type itself: once is enough
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST.replace("; charset=utf-8", ""))


@get("/v1/models", summary="List models and LoRA adapters", tags=["models"], operation_class=ApiOperation,
     responses={200: ResponseSpec(ModelList, description="Base models and adapters (`parent`: the adapter's base)",
                                  generate_examples=False), **errors(401, 429, 500, 503)})
async def list_models(request: Request[Any, Any, Any]) -> Response[bytes]:
    state = _state(request)
    if not state.catalog.loaded.is_set():
        raise ApiError.unavailable("no_capacity", "The model catalog is not loaded yet; retry shortly.", 1.0)
    cards = [ModelCard(id=m.name, created=int(ts), max_model_len=m.max_context) for m, ts in state.catalog.models()]
    contexts = {card.id: card.max_model_len for card in cards}
    warm = state.residency.cards(time.time())
    cards += [ModelCard(id=a.name, created=int(ts), parent=a.base, max_model_len=contexts.get(a.base),
                        residency=warm.get(a.name, AdapterResidencyCard())) for a, ts in state.catalog.adapters()]
    cards.sort(key=lambda card: card.id)
    return Response(encoder.encode(ModelList(data=cards)), media_type=_JSON)


@get("/openapi.json", summary="This API's OpenAPI document", tags=["operations"], include_in_schema=False)
async def openapi_json(request: Request[Any, Any, Any]) -> Response[bytes]:
    cached = getattr(request.app.state, "openapi_bytes", None)
    if cached is None:
        cached = request.app.state.openapi_bytes = encoder.encode(request.app.openapi_schema.to_schema())
    return Response(cached, media_type=_JSON)


__all__ = ["health", "list_models", "openapi_json", "prometheus_metrics", "ready"]

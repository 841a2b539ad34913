"""OpenAPI details Litestar cannot infer from the handler signatures.

The generation endpoints answer JSON or, with `stream: true`, `text/event-stream`; every
error is an `ErrorResponse`; 429 and 503 carry `Retry-After`. Litestar's default 400 body
(its validation error) is replaced by ours, since the exception handlers remap it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar.openapi import ResponseSpec
from litestar.openapi.spec import OpenAPIHeader, OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema

from services.gateway.api_common import ErrorResponse

ERROR_TEXT = {
    400: "Invalid request (`invalid_request_error`, naming `param`) or `context_length_exceeded`",
    401: "Missing or wrong API key (`invalid_api_key`)",
    404: "Unknown model or adapter (`model_not_found`)",
    413: "Request body over the gateway's limit (`request_too_large`)",
    415: "A body declared as anything but `application/json` (`unsupported_media_type`)",
    429: "API key over its rate limit (`rate_limit_exceeded`) or the model's queue is full (`queue_full`)",
    500: "Internal error (`internal_error`); details only in the gateway's log",
    503: "Draining (`draining`) or no capacity (`no_capacity`, `model_unavailable`, `redispatch_limit`)",
    504: "The request did not finish within the gateway's request timeout (`request_timeout`)",
}
SSE_SCHEMA = Schema(  # OpenAPI 3.1: the schema of one event
    type=OpenAPIType.OBJECT, required=["data"], description=(
        "One server-sent event. `data` is a chunk (the JSON of the endpoint's chunk object), then "
        "`[DONE]`; if the stream fails after it started, `{\"error\": {...}}` (an ErrorResponse) before `[DONE]`."),
    properties={"data": Schema(type=OpenAPIType.STRING), "event": Schema(type=OpenAPIType.STRING)},
)


def errors(*codes: int) -> dict[int, ResponseSpec]:
    return {code: ResponseSpec(ErrorResponse, description=ERROR_TEXT[code], generate_examples=False) for code in codes}


def generation_responses(body: Any) -> dict[int, ResponseSpec]:
    ok = {200: ResponseSpec(body, description="The completion (JSON), or its chunks as server-sent events",
                            generate_examples=False)}
    return {**ok, **errors(400, 401, 404, 413, 415, 429, 500, 503, 504)}


def _add_retry_after(responses: dict[str, Any] | None) -> None:
    for code in ("429", "503"):
        response = (responses or {}).get(code)
        if isinstance(response, OpenAPIResponse):
            response.headers = {**(response.headers or {}), "Retry-After": OpenAPIHeader(
                schema=Schema(type=OpenAPIType.STRING), description="Seconds to wait before retrying")}


@dataclass
class ApiOperation(Operation):
    def __post_init__(self) -> None:
        _add_retry_after(self.responses)  # type: ignore[arg-type]


@dataclass
class GenerationOperation(Operation):
    def __post_init__(self) -> None:
        _add_retry_after(self.responses)  # type: ignore[arg-type]
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse) and ok.content is not None:
            ok.content["text/event-stream"] = OpenAPIMediaType(schema=SSE_SCHEMA)


__all__ = ["ApiOperation", "GenerationOperation", "errors", "generation_responses"]

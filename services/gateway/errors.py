"""Every error the gateway answers, in OpenAI's shape, and the mapping of everything else onto it.

    raise ApiError.bad_request("n must be at most 8", param="n")   # -> 400 invalid_request_error

Codes are always strings (see docs/api.md for the table). A failure nobody planned for becomes
a generic 500 `internal_error`: the traceback goes to the log, never to the client.
"""
from __future__ import annotations

import math
import re
import traceback
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from services.gateway.api_common import ErrorBody, ErrorResponse
from shared.logging import get_logger

log = get_logger("tidal.gateway")
_encoder = msgspec.json.Encoder()

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    """An error answer: HTTP status, OpenAI error type, string code, the parameter at fault."""

    def __init__(self, status: int, message: str, *, type: str, code: str, param: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s

    # --- the catalog of errors ------------------------------------------------------------
    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str = INVALID_REQUEST) -> "ApiError":
        return cls(400, message, type=INVALID_REQUEST, code=code, param=param)

    @classmethod
    def context_length(cls, message: str, param: str) -> "ApiError":
        return cls(400, message, type=INVALID_REQUEST, code="context_length_exceeded", param=param)

    @classmethod
    def unauthorized(cls, message: str) -> "ApiError":
        return cls(401, message, type="authentication_error", code="invalid_api_key")

    @classmethod
    def model_not_found(cls, model: str) -> "ApiError":
        return cls(404, f"The model '{model[:256]}' does not exist (see GET /v1/models).", type=INVALID_REQUEST,
                   code="model_not_found", param="model")

    @classmethod
    def too_large(cls, limit: int) -> "ApiError":
        return cls(413, f"The request body is larger than the limit of {limit} bytes.", type=INVALID_REQUEST,
                   code="request_too_large")

    @classmethod
    def rate_limited(cls, retry_after_s: float) -> "ApiError":
        return cls(429, "Rate limit reached for this API key; retry later.", type="rate_limit_error",
                   code="rate_limit_exceeded", retry_after_s=retry_after_s)

    @classmethod
    def queue_full(cls, message: str, retry_after_s: float | None) -> "ApiError":
        return cls(429, message, type="rate_limit_error", code="queue_full", retry_after_s=retry_after_s or 1.0)

    @classmethod
    def unavailable(cls, code: str, message: str, retry_after_s: float | None = None) -> "ApiError":
        return cls(503, message, type="service_unavailable", code=code, retry_after_s=retry_after_s or 1.0)

    @classmethod
    def internal(cls) -> "ApiError":
        return cls(500, "The server had an error while processing your request.", type="internal_error",
                   code="internal_error")

    # --- rendering ------------------------------------------------------------------------
    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def encode(self) -> bytes:
        return _encoder.encode(self.body())

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"content-type", b"application/json")]
        out.extend((k.encode(), v.encode()) for k, v in self.headers().items())
        return out

    def response(self) -> Response[bytes]:
        return Response(self.encode(), status_code=self.status, media_type="application/json", headers=self.headers())


def log_failure(event: str, exc: BaseException, **fields: Any) -> None:
    """Log an unexpected exception with its traceback but without frame locals: on the HTTP path
    they hold request headers (API keys) and prompts, which must not reach the logs."""
    log.error(event, error=repr(exc)[:512], traceback="".join(traceback.format_exception(exc))[-8192:], **fields)


# --- Litestar's own exceptions, remapped ---------------------------------------------------
_MISSING = re.compile(r"missing required field `([^`]+)`")
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 415: "unsupported_media_type"}


def from_validation(exc: ValidationException) -> ApiError:
    """Litestar's body validation failure (msgspec's message and the key path) -> 400 naming the param."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    first: dict[str, Any] = extra[0] if extra and isinstance(extra[0], dict) else {}
    text = str(first.get("message") or exc.detail or "invalid request")
    key = first.get("key")
    param = str(key) if key and key != "data" else None
    if param is None:
        missing = _MISSING.search(text)
        param = missing.group(1) if missing else None
    if param is not None and not text.startswith("Object missing"):
        text = f"Invalid value for '{param}': {text}"
    elif text.startswith("Expected `object`"):
        text = f"The request body must be a JSON object: {text}"
    return ApiError.bad_request(text[:1024], param=param)


def from_http_exception(exc: HTTPException) -> ApiError:
    status = exc.status_code
    detail = str(exc.detail or "")[:1024]
    if status == 400:  # Litestar raises this for a body that is not JSON at all
        return ApiError.bad_request(f"We could not parse the JSON body of your request: {detail}")
    if status >= 500:
        return ApiError.internal()
    code = _HTTP_CODES.get(status, INVALID_REQUEST)
    kind = "not_found_error" if status == 404 else INVALID_REQUEST
    return ApiError(status, detail or "request refused", type=kind, code=code)


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Litestar's exception handler for every exception: the OpenAI shape, no internals leaked."""
    if isinstance(exc, ApiError):
        error = exc
    elif isinstance(exc, ValidationException):
        error = from_validation(exc)
    elif isinstance(exc, HTTPException) and exc.status_code < 500:
        error = from_http_exception(exc)
    elif isinstance(exc, (UnicodeDecodeError, RecursionError)):  # body_guard answers these first; a backstop
        error = ApiError.bad_request("The request body is not valid UTF-8 JSON of a decodable depth.")
    else:
        log_failure("request failed", exc, path=request.url.path)
        error = ApiError.internal()
    return error.response()


__all__ = ["ApiError", "handle_exception", "INVALID_REQUEST", "log_failure"]

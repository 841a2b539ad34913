"""What a JSON body must be before any handler sees it: the right content type, not empty, UTF-8,
JSON, no deeper than msgspec can decode, and of the route's request type.

Every way a body can be malformed is answered here with a 4xx naming the problem (415 for a
content type that is not JSON, 400 for the rest), so no hostile body reaches Litestar's own
decoding (which would raise `UnicodeDecodeError` or `RecursionError` into a 500). A body that
decodes is handed on unchanged; the decode is msgspec's lax one (numbers in strings are taken,
as Litestar takes them), so what is accepted did not change.

    guard = BodyGuard.for_type(ChatCompletionRequest)
    data_or_error = guard.check(scope_headers, body)   # the decoded request, or an ApiError
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from services.gateway.errors import ApiError

JSON_TYPES = frozenset({b"application/json"})
_PATH = re.compile(r" - at `\$(?:\.)?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def media_type(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The request's media type (lower case, parameters dropped), or None when it sent none."""
    for key, value in headers:
        if key == b"content-type":
            return value.split(b";", 1)[0].strip().lower()
    return None


def content_type_error(headers: list[tuple[bytes, bytes]]) -> ApiError | None:
    """415 for a body declared as anything but JSON. No Content-Type at all is taken as JSON, as
    vLLM's server (FastAPI) does: curl without `-H` and many scripts send none."""
    kind = media_type(headers)
    if kind is None or kind in JSON_TYPES or (kind.startswith(b"application/") and kind.endswith(b"+json")):
        return None
    shown = kind.decode("latin-1")[:100]
    return ApiError(415, f"Unsupported Content-Type '{shown}': send the body as 'application/json'.",
                    type="invalid_request_error", code="unsupported_media_type")


def decode_failure(exc: Exception, body: bytes) -> ApiError:
    """A body msgspec could not decode -> 400 naming what is wrong (and the parameter, when one is)."""
    if isinstance(exc, UnicodeDecodeError):
        try:
            body.decode("utf-8")
            where = ""
        except UnicodeDecodeError as whole:
            where = f" at byte {whole.start}"
        return ApiError.bad_request(f"The request body is not valid UTF-8: {exc.reason}{where}.")
    if isinstance(exc, RecursionError):
        return ApiError.bad_request("The JSON body is nested too deeply to be decoded.")
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        path = _PATH.search(text)
        param = path.group(1) if path and path.group(1) else None
        text = _PATH.sub("", text)
        unknown = _UNKNOWN.search(text)
        if unknown is not None and param is None:  # a top-level field no API here has
            return ApiError.bad_request(f"Unrecognized request argument supplied: {unknown.group(1)}",
                                        param=unknown.group(1))
        if param is None:
            missing = _MISSING.search(text)
            param = missing.group(1) if missing else None
            if missing is None and text.startswith("Expected `object`"):
                return ApiError.bad_request(f"The request body must be a JSON object: {text}"[:1024])
            return ApiError.bad_request(text[:1024], param=param)
        return ApiError.bad_request(f"Invalid value for '{param}': {text}"[:1024], param=param)
    return ApiError.bad_request(f"We could not parse the JSON body of your request: {text}"[:1024])


@dataclass(frozen=True)
class BodyGuard:
    """One route's body check; `strict` decodes the common case without msgspec's coercions."""

    strict: msgspec.json.Decoder[Any]
    lax: msgspec.json.Decoder[Any]

    @classmethod
    def for_type(cls, request_type: type) -> "BodyGuard":
        return cls(msgspec.json.Decoder(request_type), msgspec.json.Decoder(request_type, strict=False))

    def check(self, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[Any, bool] | ApiError:
        """(the request, whether it decoded strictly), or the error to answer."""
        refused = content_type_error(headers)
        if refused is not None:
            return refused
        if not body.strip():
            return ApiError.bad_request("The request body is empty: send a JSON object.")
        try:  # msgspec skips unknown keys and values without checking their encoding: check it all
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return decode_failure(exc, body)
        try:
            return self.strict.decode(body), True
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as first:
            if not isinstance(first, msgspec.ValidationError):
                return decode_failure(first, body)
        try:
            return self.lax.decode(body), False
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as exc:
            return decode_failure(exc, body)


__all__ = ["BodyGuard", "content_type_error", "decode_failure", "media_type"]

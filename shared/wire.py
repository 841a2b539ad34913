"""The wire format shared by every Tidal service: msgpack via msgspec, header names, typed errors.

Every payload on the bus is a `msgspec.Struct` encoded as msgpack. Metadata travels in NATS
headers, never inside payloads:

| header                  | meaning                                                                |
| ----------------------- | ---------------------------------------------------------------------- |
| `traceparent`           | W3C trace context (`00-<trace id>-<span id>-<flags>`)                  |
| `tracestate`            | W3C trace state (vendor data), forwarded with `traceparent`            |
| `tidal-request-id`      | the client request this message serves (log correlation)               |
| `tidal-idempotency-key` | on commands: the same key means the same command (safe to retry)       |
| `tidal-deadline`        | absolute deadline, Unix epoch milliseconds; a responder may skip work  |
|                         | whose caller already gave up                                           |
| `tidal-error`           | on replies: the payload is an `ErrorReply`; the value is its code      |

An absolute wall-clock deadline (not a relative timeout) is used so that time spent queued
in NATS or in a mailbox counts against it; hosts are expected to run NTP.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Final

import msgspec

# --- header names (NATS header keys are case-sensitive in nats-py: always use these) ---
HDR_TRACEPARENT: Final = "traceparent"
HDR_TRACESTATE: Final = "tracestate"
HDR_REQUEST_ID: Final = "tidal-request-id"
HDR_IDEMPOTENCY_KEY: Final = "tidal-idempotency-key"
HDR_DEADLINE: Final = "tidal-deadline"
HDR_ERROR: Final = "tidal-error"

# --- error codes carried by ErrorReply.code ---
BAD_REQUEST: Final = "bad_request"  # undecodable payload or a field out of range
UNKNOWN_MESSAGE: Final = "unknown_message"  # a tag this subject does not know
DEADLINE_EXCEEDED: Final = "deadline_exceeded"  # the caller's deadline passed before the work was done
CONFLICT: Final = "conflict"  # compare-and-set lost, or the key already exists
NOT_FOUND: Final = "not_found"
UNAVAILABLE: Final = "unavailable"  # nobody can serve this right now (no responders, draining)
INTERNAL: Final = "internal"  # a bug on the responder side; details are in its log, not in the reply
ERROR_CODES: Final = frozenset(
    {BAD_REQUEST, UNKNOWN_MESSAGE, DEADLINE_EXCEEDED, CONFLICT, NOT_FOUND, UNAVAILABLE, INTERNAL}
)


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    """A reply that reports a failure; flagged by the `tidal-error` header (value = code)."""

    code: str  # one of ERROR_CODES (services may add their own, documented, codes)
    message: str  # human readable; never a traceback
    field: str | None = None  # the offending field path (e.g. "max_tokens"), where one is known


# --- exceptions: raised locally, and turned into ErrorReply by the responder runtime ---
class TidalError(Exception):
    """An error with a wire code. Raise one in a handler to answer with that code."""

    code: str = INTERNAL

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.field = field

    def to_reply(self) -> ErrorReply:
        return ErrorReply(code=self.code, message=self.message, field=self.field)


class BadRequest(TidalError):
    code = BAD_REQUEST


class UnknownMessage(TidalError):
    code = UNKNOWN_MESSAGE


class NotFound(TidalError):
    code = NOT_FOUND


class Conflict(TidalError):
    code = CONFLICT


class Unavailable(TidalError):
    code = UNAVAILABLE


class DeadlineExceeded(TidalError):
    """The request's deadline passed (raised by `Bus.request` at about the deadline)."""

    code = DEADLINE_EXCEEDED


class NoResponders(Unavailable):
    """Nobody is subscribed to the subject (or every responder is draining)."""

    def __init__(self, subject: str) -> None:
        super().__init__(f"no responders on {subject!r}")
        self.subject = subject


class RemoteError(TidalError):
    """The responder answered with an ErrorReply; `.code`, `.message`, `.field` are its fields."""

    def __init__(self, subject: str, reply: ErrorReply) -> None:
        where = f" (field {reply.field!r})" if reply.field else ""
        super().__init__(f"{subject}: {reply.code}: {reply.message}{where}", code=reply.code, field=reply.field)
        self.message = reply.message
        self.subject = subject
        self.reply = reply


class BadReply(TidalError):
    """The reply could not be decoded as the expected type (a contract mismatch between services)."""

    code = BAD_REQUEST


class RevisionConflict(Conflict):
    """A KV compare-and-set lost: the key is not at the revision the writer read."""

    def __init__(self, bucket: str, key: str, expected: int, actual: int | None) -> None:
        now = "absent" if actual is None else f"at revision {actual}"
        super().__init__(f"{bucket}/{key}: expected revision {expected}, but the key is {now}", field=key)
        self.bucket = bucket
        self.key = key
        self.expected = expected
        self.actual = actual


class KeyExists(RevisionConflict):
    """A KV create found the key already present."""

    def __init__(self, bucket: str, key: str, actual: int | None) -> None:
        super().__init__(bucket, key, 0, actual)
        self.message = f"{bucket}/{key}: already exists (revision {actual})"
        self.args = (self.message,)


# --- encoding ---
_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode  # Struct -> bytes; one shared encoder (they are thread-safe and cheap to reuse)


@functools.lru_cache(maxsize=None)
def decoder_for(msg_type: Any) -> msgspec.msgpack.Decoder:
    """A cached msgpack decoder for a Struct type or a (tagged) union of Structs."""
    return msgspec.msgpack.Decoder(msg_type)


def decode(data: bytes, msg_type: Any) -> Any:
    return decoder_for(msg_type).decode(data)


_error_reply_decoder = msgspec.msgpack.Decoder(ErrorReply)


def decode_error_reply(data: bytes) -> ErrorReply:
    """Decode an ErrorReply; a garbled one becomes an `internal` error rather than a crash."""
    try:
        return _error_reply_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        return ErrorReply(code=INTERNAL, message=f"undecodable error reply: {exc}")


_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def tag_fields(msg_type: Any) -> frozenset[str]:
    """The tag field names of a Struct type or a union of Structs (used to spot unknown tags)."""
    members = getattr(msg_type, "__args__", None) or (msg_type,)
    fields = set()
    for member in members:
        config = getattr(member, "__struct_config__", None)
        if config is not None and config.tag_field is not None and config.tag is not None:
            fields.add(config.tag_field)
    return frozenset(fields)


def error_for_decode_failure(exc: msgspec.MsgspecError, tags: frozenset[str]) -> ErrorReply:
    """Map a msgspec decode failure to a typed ErrorReply naming what is wrong.

    Garbage bytes and wrong types are `bad_request`; a tag value the subject does not know is
    `unknown_message`. `tags` is `tag_fields(expected type)`.
    """
    text = str(exc)
    # ValidationError subclasses DecodeError: only a plain DecodeError means the bytes are not msgpack
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return ErrorReply(code=BAD_REQUEST, message=f"undecodable payload: {text}")
    path = _AT_PATH.search(text) or _MISSING.search(text)
    field = path.group(1) if path else None
    if field in tags and text.startswith("Invalid value"):
        return ErrorReply(code=UNKNOWN_MESSAGE, message=f"unknown message type: {text}", field=field)
    return ErrorReply(code=BAD_REQUEST, message=f"invalid message: {text}", field=field or None)

"""Unit tests of the wire format: decode failures map to typed, named errors (no I/O)."""
from __future__ import annotations

from typing import Union

import msgspec
import pytest

from shared.wire import (
    BAD_REQUEST, CONFLICT, ERROR_CODES, UNKNOWN_MESSAGE, ErrorReply, KeyExists, NotFound, RemoteError,
    RevisionConflict, decode, decode_error_reply, encode, error_for_decode_failure, tag_fields,
)


class Load(msgspec.Struct, tag="load", tag_field="type"):
    model: str
    max_tokens: int


class Evict(msgspec.Struct, tag="evict", tag_field="type"):
    model: str


Command = Union[Load, Evict]


def failure(data: bytes, msg_type: object) -> ErrorReply:
    with pytest.raises(msgspec.MsgspecError) as info:
        decode(data, msg_type)
    return error_for_decode_failure(info.value, tag_fields(msg_type))


def test_round_trip_of_a_tagged_union() -> None:
    assert decode(encode(Evict(model="m")), Command) == Evict(model="m")


def test_garbage_bytes_are_a_bad_request() -> None:
    error = failure(b"\xc1\xc1 not msgpack", Command)
    assert error.code == BAD_REQUEST
    assert "undecodable" in error.message


def test_wrong_field_type_names_the_field() -> None:
    error = failure(msgspec.msgpack.encode({"type": "load", "model": "m", "max_tokens": "many"}), Command)
    assert error.code == BAD_REQUEST
    assert error.field == "max_tokens"
    assert "Expected `int`, got `str`" in error.message


def test_missing_field_names_the_field() -> None:
    error = failure(msgspec.msgpack.encode({"type": "load", "model": "m"}), Command)
    assert (error.code, error.field) == (BAD_REQUEST, "max_tokens")


def test_unknown_tag_is_unknown_message() -> None:
    error = failure(msgspec.msgpack.encode({"type": "explode", "model": "m"}), Command)
    assert error.code == UNKNOWN_MESSAGE
    assert error.field == "type"
    assert "explode" in error.message


def test_a_tag_of_another_family_is_unknown_for_a_single_struct_subject() -> None:
    error = failure(encode(Evict(model="m")), Load)
    assert error.code == UNKNOWN_MESSAGE


def test_tag_fields_of_untagged_struct_is_empty() -> None:
    class Plain(msgspec.Struct):
        x: int

    assert tag_fields(Plain) == frozenset()
    assert tag_fields(Command) == frozenset({"type"})


def test_error_reply_round_trip_and_garbled_error_reply() -> None:
    reply = ErrorReply(code=CONFLICT, message="lost", field="k")
    assert decode_error_reply(encode(reply)) == reply
    assert decode_error_reply(b"\xc1").code == "internal"


def test_exceptions_carry_codes_and_names() -> None:
    conflict = RevisionConflict("models", "llama", expected=3, actual=5)
    assert conflict.code == CONFLICT and conflict.key == "llama"
    assert "expected revision 3" in str(conflict) and "revision 5" in str(conflict)
    assert "absent" in str(RevisionConflict("models", "llama", 3, None))
    exists = KeyExists("models", "llama", 7)
    assert isinstance(exists, RevisionConflict) and "already exists" in str(exists)
    expected = ErrorReply(code="not_found", message="no such model", field="name")
    assert NotFound("no such model", field="name").to_reply() == expected
    remote = RemoteError("tidal.v1.x", ErrorReply(code="not_found", message="gone", field="name"))
    assert (remote.code, remote.message, remote.field) == ("not_found", "gone", "name")
    codes = {"bad_request", "unknown_message", "deadline_exceeded", "conflict", "not_found", "unavailable", "internal"}
    assert codes == ERROR_CODES

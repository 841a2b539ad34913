"""Base classes and bounded field types shared by every Tidal message.

Conventions (one for the whole catalog, see docs/subjects.md):

* Every message sent on a subject subclasses `Message`: a frozen, keyword-only
  `msgspec.Struct` tagged in the field `"type"` with the snake_case class name
  (`SubmitRequest` -> `"submit_request"`). Tags are unique across the catalog, so any
  message is self-describing and a subject family is a tagged union of its messages.
* Nested values (sampling parameters, usage, layer ranges, ...) subclass `Value`: frozen,
  keyword-only, untagged.
* Every field is encoded, defaults included, so a reader in any language sees every field
  without applying the schema's defaults. Unknown fields are ignored on decode, so a v1
  field may be added (with a default) without breaking v1 readers; removing or retyping a
  field means `tidal.v2`.
* Every field is bounded (`Meta` constraints): a decoder rejects out-of-range values,
  so a handler never sees an unbounded string or list.
"""
from __future__ import annotations

import re
from typing import Annotated, Final, Literal

import msgspec
from msgspec import Meta

# --- limits on the wire (operational limits are tighter; see [gateway.limits] in the config) ---
MAX_PROMPT_TOKENS: Final = 262_144
MAX_OUTPUT_TOKENS: Final = 262_144
MAX_CHUNK_TOKENS: Final = 4096
MAX_TEXT_CHARS: Final = 65_536
MAX_MESSAGE_CHARS: Final = 2048  # human-readable reasons and error messages
MAX_PATH_CHARS: Final = 4096
MAX_LIST: Final = 4096  # entries in a list of records/holdings/instances in one message
MAX_LAYERS: Final = 4096
MAX_BYTES: Final = 2**53  # exact in a float: safe for JSON consumers too

# Identifiers that appear as a subject token: no '.', '*', '>' or whitespace, <= 64 chars.
ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
# Model and adapter names may also contain '.' ("qwen2.5-0.5b"); in a subject token the '.'
# is percent-encoded (see shared.subjects.subject_token).
NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"

RequestId = Annotated[
    str, Meta(pattern=ID_PATTERN, max_length=64, description="Client request id: [A-Za-z0-9_-], 1-64 chars.")
]
WorkerId = Annotated[
    str, Meta(pattern=ID_PATTERN, max_length=64, description="Worker id (one per device): [A-Za-z0-9_-], 1-64 chars.")
]
InstanceId = Annotated[str, Meta(pattern=ID_PATTERN, max_length=64, description="Model instance id.")]
GroupId = Annotated[str, Meta(pattern=ID_PATTERN, max_length=64, description="Buddy group id.")]
PlanId = Annotated[str, Meta(pattern=ID_PATTERN, max_length=64, description="Plan id.")]
ServiceId = Annotated[
    str, Meta(pattern=ID_PATTERN, max_length=64, description="One running service process, e.g. 'dispatcher-a1b2c3'.")
]
ModelName = Annotated[
    str, Meta(pattern=NAME_PATTERN, max_length=64, description="Base model name: [A-Za-z0-9._-], 1-64 chars.")
]
AdapterName = Annotated[
    str, Meta(pattern=NAME_PATTERN, max_length=64, description="LoRA adapter name: [A-Za-z0-9._-], 1-64 chars.")
]
IdempotencyKey = Annotated[
    str,
    Meta(min_length=1, max_length=128, description="Same key, same command: a retried command is applied once."),
]
ServiceName = Literal["gateway", "dispatcher", "planner", "predictor", "registry", "gpu_worker"]
Device = Annotated[str, Meta(pattern=r"^(cpu|cuda:[0-9]{1,3})$", description="'cpu' or 'cuda:N'.")]

Timestamp = Annotated[float, Meta(ge=0, description="Unix time in seconds.")]
Seconds = Annotated[float, Meta(ge=0, le=1e9, description="A duration in seconds.")]
ByteCount = Annotated[int, Meta(ge=0, le=MAX_BYTES, description="A size in bytes.")]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Seq = Annotated[int, Meta(ge=0, le=2**53, description="Sequence number, starts at 0, +1 per message.")]
Revision = Annotated[int, Meta(ge=0, le=2**63 - 1, description="JetStream KV revision; 0 means 'absent'.")]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
Attempt = Annotated[int, Meta(ge=0, le=100, description="Re-dispatches of a request so far.")]
Handover = Annotated[int, Meta(ge=0, le=1_000_000, description="Live migrations within one attempt so far.")]
Rate = Annotated[float, Meta(ge=0, le=1e12, description="Per second.")]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
Reason = Annotated[str, Meta(max_length=MAX_MESSAGE_CHARS, description="Human-readable; never a traceback.")]
FilePath = Annotated[str, Meta(min_length=1, max_length=MAX_PATH_CHARS)]


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(class_name: str) -> str:
    """`SubmitRequest` -> `submit_request`; the tag of a Message class."""
    return _CAMEL.sub("_", class_name).lower()


class Message(
    msgspec.Struct,
    tag_field="type",
    tag=snake_case,
    frozen=True,
    kw_only=True,
    gc=False,  # messages hold no reference cycles; keeps them out of the cyclic GC
):
    """A payload sent on a subject: tagged in `type` with its snake_case class name."""


class Value(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A nested value inside a Message (untagged)."""


def message_tag(cls: type[Message]) -> str:
    """The wire tag (`type` field value) of a Message class."""
    return cls.__struct_config__.tag  # type: ignore[return-value]

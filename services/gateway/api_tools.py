"""HTTP bodies of structured outputs and tool calling (OpenAI's and vLLM's shapes).

    response_format: {"type": "text" | "json_object"} | {"type": "json_schema", "json_schema": {...}}
    tools: [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    structured_outputs (vLLM): {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$",
                                   description="Letters, digits, '_', '.', '-'; at most 64.")]
JsonSchemaObject = Annotated[dict[str, Any], Meta(description="A JSON Schema.")]
Logits = Annotated[float, Meta(ge=-100, le=100)]
LogitBias = Annotated[dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Logits], Meta(
    max_length=1024, description="Token id (a string of digits) -> a value in [-100, 100] added to its logit.")]


class ResponseFormatText(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    pass


class ResponseFormatJsonObject(msgspec.Struct, kw_only=True, tag_field="type", tag="json_object"):
    pass


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema: JsonSchemaObject | None = None  # None: any JSON object
    strict: bool | None = None  # always strict here: the grammar enforces the schema


class ResponseFormatJsonSchema(msgspec.Struct, kw_only=True, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaFormat


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (exactly one constraint)."""

    json: JsonSchemaObject | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar
    json_object: bool | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: JsonSchemaObject | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: Annotated[str, Meta(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


__all__ = [
    "ChatTool", "DeltaFunctionCall", "DeltaToolCall", "FunctionCall", "FunctionDefinition", "JsonSchemaFormat",
    "LogitBias", "NamedToolChoice", "ResponseFormat", "ResponseFormatJsonObject", "ResponseFormatJsonSchema",
    "ResponseFormatText", "StructuredOutputs", "ToolCall", "ToolChoice",
]

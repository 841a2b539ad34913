"""Tool calling: tool_choice's meaning, the grammar of a forced call, and tool calls parsed from text.

    mode = tool_mode(data)              # None without tools; a 400 for a tool_choice that names no tool
    mode.template_tools()               # what the chat template renders (Qwen2.5, Llama 3.x, Mistral, Hermes)
    mode.forced()                       # ("json_schema", spec) for "required" / a named function
    content, calls = mode.parse(text)   # OpenAI's tool_calls out of the model's text

"required" and a named function go through the grammar, as vLLM does, whatever the chat
template's own call format: "required" makes the model write a JSON list of
`{"name", "parameters"}` (one of the tools each, at most one when parallel_tool_calls is false);
a named function makes it write that function's arguments. "auto" lets the model choose and
parses what it wrote: Hermes/Qwen2.5 `<tool_call>{...}</tool_call>` blocks, or (Llama 3.x JSON
tool calls, Mistral's list) an answer that is nothing but `{"name", "arguments" | "parameters"}`
objects naming a tool. "none" renders the tools and parses nothing.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from services.gateway.api_tools import ChatTool, FunctionCall, ToolCall
from services.gateway.errors import ApiError

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HOLD_PREFIXES = ("<tool_call>", "{", "[")  # what an "auto" answer that is a call starts with


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "none" | "auto" | "required" | "named"
    tools: list[ChatTool]
    name: str | None = None  # the named function
    parallel: bool = True

    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": t.function.name, "description": t.function.description or "",
                                                   "parameters": t.function.parameters or {"type": "object"}}}
                for t in self.tools]

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return tool.function.parameters or {"type": "object"}

    def forced(self) -> tuple[str, str] | None:
        """The grammar that makes the model call: (kind, spec), or None when it may answer in text."""
        if self.choice == "named":
            assert self.name is not None
            return "json_schema", json.dumps(self._parameters(self.name), ensure_ascii=False)
        if self.choice != "required":
            return None
        items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": self._parameters(t.function.name)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema, ensure_ascii=False)

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content left, the calls); no calls: the text unchanged."""
        if self.choice == "named":
            return (None, [_call(self.name or "", text)]) if _is_json(text) else (text, [])
        if self.choice == "required":
            found = _objects(text)
            return (None, found) if found else (text, [])
        if self.choice != "auto":
            return text, []
        blocks = _HERMES.findall(text)
        if blocks:
            calls = [c for b in blocks for c in _objects(b, self.names)]
            if calls:
                rest = _HERMES.sub("", text).strip()
                return (rest or None), calls
        calls = _objects(text, self.names)
        return (None, calls) if calls else (text, [])

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def _objects(text: str, names: frozenset[str] | None = None) -> list[ToolCall]:
    """`{"name", "arguments"|"parameters"}` objects (one, or a list) naming known tools; [] otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls: list[ToolCall] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if names is not None and item["name"] not in names:
            return []
        calls.append(_call(item["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return calls


def tool_mode(data: Any) -> ToolMode | None:
    """The request's tool mode, or None when it has no tools (a tool_choice other than none is then a 400)."""
    choice = data.tool_choice
    if not data.tools:
        if choice is not None and choice != "none":
            raise ApiError.bad_request("tool_choice needs tools", param="tool_choice")
        return None
    parallel = data.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        return ToolMode(choice or "auto", data.tools, parallel=parallel)
    name = choice.function.name
    if name not in {t.function.name for t in data.tools}:
        raise ApiError.bad_request(f"tool_choice names the function '{name}', which is not in tools",
                                   param="tool_choice")
    return ToolMode("named", data.tools, name=name, parallel=parallel)


def history_message(message: Any) -> dict[str, Any]:
    """One chat message as chat templates read it (tool calls' arguments as objects, as HF templates expect)."""
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in message.tool_calls]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        turn["name"] = message.name
    return turn


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


__all__ = ["HOLD_PREFIXES", "ToolMode", "history_message", "new_call_id", "tool_mode"]

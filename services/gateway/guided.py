"""A request's structured-output constraint, from whichever field asked for it, checked before submit.

OpenAI's `response_format` and vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` / `structured_outputs` (and a forced tool call, tool_calls.py) all become one
`Guided` on the wire; at most one of them may be given, and its schema, regex or grammar must
compile (llguidance's own check, cached per spec) or the request is a 400 naming the field.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from services.gateway.api_tools import ResponseFormatJsonObject, ResponseFormatJsonSchema, StructuredOutputs
from services.gateway.errors import ApiError
from services.gpu_worker.engine.structured import GrammarError, check_grammar
from shared.events.common import MAX_GUIDED_SPEC, Guided

Source = tuple[str, str, str]  # (the request field, kind, spec)


def _schema_text(schema: dict[str, Any] | str) -> str:
    if isinstance(schema, str):
        return schema
    return json.dumps(schema, ensure_ascii=False)


def _structured(so: StructuredOutputs) -> list[Source]:
    out: list[Source] = []
    if so.json is not None:
        out.append(("structured_outputs.json", "json_schema", _schema_text(so.json)))
    if so.regex is not None:
        out.append(("structured_outputs.regex", "regex", so.regex))
    if so.choice is not None:
        out.append(("structured_outputs.choice", "choice", json.dumps(so.choice, ensure_ascii=False)))
    if so.grammar is not None:
        out.append(("structured_outputs.grammar", "lark", so.grammar))
    if so.json_object:
        out.append(("structured_outputs.json_object", "json_object", ""))
    return out


def sources_of(data: Any) -> list[Source]:
    """Every constraint the request asks for (fields common to chat and completions)."""
    out: list[Source] = []
    rf = data.response_format
    if isinstance(rf, ResponseFormatJsonObject):
        out.append(("response_format", "json_object", ""))
    elif isinstance(rf, ResponseFormatJsonSchema):
        schema = rf.json_schema.schema
        out.append(("response_format", "json_object", "") if schema is None else
                   ("response_format", "json_schema", _schema_text(schema)))
    if data.guided_json is not None:
        out.append(("guided_json", "json_schema", _schema_text(data.guided_json)))
    if data.guided_regex is not None:
        out.append(("guided_regex", "regex", data.guided_regex))
    if data.guided_choice is not None:
        out.append(("guided_choice", "choice", json.dumps(data.guided_choice, ensure_ascii=False)))
    if data.guided_grammar is not None:
        out.append(("guided_grammar", "lark", data.guided_grammar))
    if data.structured_outputs is not None:
        found = _structured(data.structured_outputs)
        if len(found) != 1:
            raise ApiError.bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                       "json_object", param="structured_outputs")
        out += found
    return out


@lru_cache(maxsize=256)
def _checked(kind: str, spec: str) -> str | None:
    """None if the spec compiles, else why not (cached: clients repeat their schemas)."""
    try:
        check_grammar(kind, spec)
    except GrammarError as exc:
        return str(exc)
    return None


def guided_of(sources: list[Source]) -> Guided | None:
    """The one constraint, checked; a 400 naming the field if there are several or it does not compile."""
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(s[0] for s in sources)
        raise ApiError.bad_request(f"Only one structured-output constraint may be given; got {names}.",
                                   param=sources[1][0])
    param, kind, spec = sources[0]
    if len(spec) > MAX_GUIDED_SPEC:
        raise ApiError.bad_request(f"{param} is longer than {MAX_GUIDED_SPEC} characters", param=param)
    why = _checked(kind, spec)
    if why is not None:
        raise ApiError.bad_request(f"Invalid {param}: {why}"[:1024], param=param)
    return Guided(kind=kind, spec=spec)  # type: ignore[arg-type]


__all__ = ["Source", "guided_of", "sources_of"]

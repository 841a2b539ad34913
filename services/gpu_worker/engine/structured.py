"""Structured output: a request's constraint as an llguidance grammar, checked before it is run.

    grammar = grammar_of("json_schema", '{"type": "object", ...}')   # GrammarError naming what is wrong
    check_grammar("regex", "[0-9]+")                                  # the same check, nothing kept

llguidance (guidance-ai, Rust, no dependencies) is the grammar engine: it computes the token
mask of a step lazily from the grammar's lexer and Earley parser (tens of microseconds per
token, no per-schema compilation step), handles JSON schema, regular expressions and Lark
grammars, and installs as one abi3 wheel on CPU and GPU hosts alike; vLLM ships it as its
`guidance` backend. xgrammar (vLLM's default) needs torch, transformers and triton on Linux and
compiles each new schema before its first token; outlines-core builds a full regex automaton
per schema up front. See docs/api.md#structured-outputs.

JSON is generated compact with single spaces (`{"a": 1, "b": [2, 3]}`) and no free whitespace:
a small model given free whitespace can fill `max_tokens` with newlines. No torch here: the
gateway imports this module to refuse a bad schema with a 400 before anything is submitted.
"""
from __future__ import annotations

import json
from typing import Any

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled; the message says why."""


def grammar_of(kind: str, spec: str) -> str:
    """The llguidance grammar (its JSON text) for a constraint of `kind`."""
    if kind == "json_object":
        spec = ANY_OBJECT
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object (or true/false)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("the choices must be a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise GrammarError(f"unknown structured-output kind {kind!r}; known: {', '.join(KINDS)}")


def check_grammar(kind: str, spec: str) -> str:
    """The compiled grammar, after llguidance validated it (GrammarError with its message if not)."""
    grammar = grammar_of(kind, spec)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {kind.replace('_', ' ')}: {error}"[:1024])
    return grammar


__all__ = ["ANY_OBJECT", "GrammarError", "JSON_OPTIONS", "KINDS", "check_grammar", "grammar_of"]

"""Structured output in the sampler: llguidance's token masks, per sequence, in a mixed batch.

The logits are random (any model's could be anything), so what comes out is whatever the grammar
allows; each finished output must parse and validate against its schema with `jsonschema`
(written by others), match its regex, or be one of its choices. Unguided rows in the same batch
are left alone.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from services.gpu_worker.engine.sampler import Sampler
from services.gpu_worker.engine.sampling_params import SamplingParams
from services.gpu_worker.engine.structured import GrammarError, check_grammar
from services.gpu_worker.engine.tokenizer import EngineTokenizer, save_tokenizer, train_tokenizer

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
     "maxItems": 3}}, "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "t": {"type": "number",
     "minimum": -50, "maximum": 50}}, "required": ["city"], "additionalProperties": False},
    {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
     "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> EngineTokenizer:
    directory = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(512), directory)
    return EngineTokenizer.from_dir(directory)


def run(tokenizer: EngineTokenizer, params: list[SamplingParams], seed: int, steps: int = 120) -> list[tuple[str, bool]]:
    """Decode a batch on random logits until every row ends (EOS) or `steps`; (text, ended) per row."""
    vocab = tokenizer.vocab_size + 7  # a model's logits are often wider than its tokenizer
    sampler = Sampler(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in params]
    ended = [False] * len(params)
    ids = [f"s{seed}-{i}" for i in range(len(params))]
    for _ in range(steps):
        live = [i for i in range(len(params)) if not ended[i]]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 3
        out = sampler.sample(logits, [ids[i] for i in live], [params[i] for i in live],
                             outputs=[outputs[i] for i in live])
        for i, token in zip(live, out.token_ids):
            if token in tokenizer.eos_token_ids:
                ended[i] = True
            else:
                outputs[i].append(token)
    return [(tokenizer.decode(o), e) for o, e in zip(outputs, ended)]


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_outputs_validate_in_a_mixed_batch(tokenizer: EngineTokenizer, seed: int) -> None:
    params = [SamplingParams(temperature=1.0, seed=seed * 31 + i, max_tokens=200,
                             guided=("json_schema", json.dumps(schema))) for i, schema in enumerate(SCHEMAS)]
    params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=200))  # unguided, same batch
    params.append(SamplingParams(temperature=0, max_tokens=200, guided=("json_object", "")))  # greedy row
    results = run(tokenizer, params, seed)
    for schema, (text, ended) in zip(SCHEMAS, results):
        assert ended, (schema, text)
        jsonschema.validate(json.loads(text), schema)
    text, _ = results[-1]
    assert isinstance(json.loads(text), dict)
    unguided, _ = results[-2]
    with pytest.raises(ValueError):  # free text on random logits is no JSON
        json.loads(unguided)


@pytest.mark.parametrize("seed", range(3))
def test_regex_and_choice_outputs_match(tokenizer: EngineTokenizer, seed: int) -> None:
    choices = ["yes", "no", "maybe so"]
    params = [SamplingParams(temperature=1.0, seed=seed, guided=("regex", r"[A-Z][a-z]{2,5}-[0-9]{3}")),
              SamplingParams(temperature=1.0, seed=seed + 1, guided=("choice", json.dumps(choices))),
              SamplingParams(temperature=1.0, seed=seed + 2, guided=("lark", 'start: "(" NUM ("+" NUM)* ")"\n'
                                                                              "NUM: /[0-9]{1,2}/"))]
    (regex, r_end), (choice, c_end), (lark, l_end) = run(tokenizer, params, seed)
    assert r_end and re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", regex), regex
    assert c_end and choice in choices
    assert l_end and re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", lark), lark


def test_a_resumed_sequence_catches_up_with_its_tokens(tokenizer: EngineTokenizer) -> None:
    """A matcher follows the output tokens it is given, so a sequence resumed mid-way (another
    sampler, its first tokens already out) continues the same grammar."""
    schema = SCHEMAS[0]
    p = SamplingParams(temperature=0, guided=("json_schema", json.dumps(schema)))
    prefix = tokenizer.encode('{"name": "ab', add_special_tokens=False)
    sampler = Sampler(tokenizer)
    outputs = list(prefix)
    for _ in range(60):
        (token,) = sampler.sample(torch.randn(1, tokenizer.vocab_size), ["r"], [p], outputs=[outputs]).token_ids
        if token in tokenizer.eos_token_ids:
            break
        outputs.append(token)
    jsonschema.validate(json.loads(tokenizer.decode(outputs)), schema)


@pytest.mark.parametrize("kind, spec, words", [
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("json_schema", '{"type": "frobnicate"}', "json schema"),
    ("regex", "([a-z]", "regex"),
    ("choice", "[]", "non-empty list"),
    ("lark", "start: foo", "lark"),
])
def test_a_bad_spec_is_refused_with_the_reason(kind: str, spec: str, words: str) -> None:
    with pytest.raises(GrammarError, match=f"(?i){words}"):
        check_grammar(kind, spec)

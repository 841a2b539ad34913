"""vLLM / OpenAI parity through a real cluster (nats-server, registry, dispatcher, gateway, one
gpu_worker serving the tiny llama model), with the official `openai` client and httpx.

Structured outputs are validated with `jsonschema`; tool calls are parsed with `json`; each field of
the official client's request types is either served or refused with a 400 naming it. The tiny
model's weights are random, so what it writes is whatever the grammar allows — which is the point.
"""
from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from e2e.assets import LLAMA, TinyAssets
from e2e.cluster import ClusterSpec, E2ECluster

pytestmark = pytest.mark.timeout(240)

SPEC = ClusterSpec(workers={"w0": [LLAMA]})
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer",
     "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
     "maxItems": 3}}, "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def cluster(assets: TinyAssets, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    running = E2ECluster(tmp_path_factory.mktemp("parity"), SPEC, assets).start()
    try:
        yield running
    finally:
        running.stop()


def post(cluster: E2ECluster, path: str, body: Any) -> httpx.Response:
    return httpx.post(cluster.base_url + path, json=body, timeout=120)


def test_null_is_unset_for_optional_fields(cluster: E2ECluster) -> None:
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "seed": None,
             "logprobs": None, "presence_penalty": None, "logit_bias": None, "response_format": None, "tools": None,
             "tool_choice": None, "stream_options": None, "user": None, "max_tokens": 4}
    resp = post(cluster, "/v1/chat/completions", {"model": LLAMA, "messages": USER, **nulls})
    assert resp.status_code == 200, resp.text
    resp = post(cluster, "/v1/completions", {"model": LLAMA, "prompt": "Hi", "best_of": None, "echo": None,
                                             "suffix": None, **{k: v for k, v in nulls.items() if "tool" not in k}})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("seed", range(2))
def test_json_schema_outputs_validate(cluster: E2ECluster, seed: int) -> None:
    client = cluster.openai()
    for i, schema in enumerate(SCHEMAS):
        got = client.chat.completions.create(
            model=LLAMA, messages=USER, max_tokens=200, temperature=1.0, seed=seed * 10 + i,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        (choice,) = got.choices
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
    done = client.completions.create(model=LLAMA, prompt="Answer:", max_tokens=100, temperature=0,
                                     extra_body={"guided_json": SCHEMAS[0]})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMAS[0])
    obj = client.chat.completions.create(model=LLAMA, messages=USER, max_tokens=200,  # type: ignore[arg-type]
                                         temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_regex_and_choice(cluster: E2ECluster) -> None:
    client = cluster.openai()
    got = client.completions.create(model=LLAMA, prompt="Code:", max_tokens=20, temperature=1.0, seed=3,
                                    extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert len(got.choices[0].text) == 6 and got.choices[0].text[3] == "-"
    pick = client.chat.completions.create(model=LLAMA, messages=USER, max_tokens=10,  # type: ignore[arg-type]
                                          extra_body={"guided_choice": ["sunny", "rainy"]})
    assert pick.choices[0].message.content in ("sunny", "rainy")


def test_a_bad_schema_or_two_constraints_are_400_naming_the_field(cluster: E2ECluster) -> None:
    bad = post(cluster, "/v1/chat/completions", {"model": LLAMA, "messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    bogus = post(cluster, "/v1/chat/completions", {"model": LLAMA, "messages": USER, "response_format": {"type": "bogus"}})
    assert bogus.status_code == 400 and bogus.json()["error"]["param"] == "response_format.type", bogus.text
    two = post(cluster, "/v1/completions", {"model": LLAMA, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})
    assert two.status_code == 400 and two.json()["error"]["param"] == "guided_choice", two.text


def test_tool_choice_required_and_named_return_parseable_calls(cluster: E2ECluster) -> None:
    client = cluster.openai()
    for seed in range(3):
        got = client.chat.completions.create(model=LLAMA, messages=USER, tools=[WEATHER, TIME],  # type: ignore[list-item,arg-type]
                                             tool_choice="required", max_tokens=200, temperature=1.0, seed=seed)
        (choice,) = got.choices
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])  # type: ignore[index]
    named = client.chat.completions.create(
        model=LLAMA, messages=USER, tools=[WEATHER, TIME], max_tokens=100, temperature=0,  # type: ignore[list-item,arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    single = client.chat.completions.create(model=LLAMA, messages=USER, tools=[WEATHER, TIME], max_tokens=200,  # type: ignore[list-item,arg-type]
                                            tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5)
    assert len(single.choices[0].message.tool_calls or []) == 1


def test_tool_calls_stream_as_deltas_and_the_history_goes_back(cluster: E2ECluster) -> None:
    client = cluster.openai()
    calls: dict[int, dict[str, str]] = {}
    finish = None
    # one call: greedy on random weights would otherwise repeat calls until max_tokens
    for chunk in client.chat.completions.create(model=LLAMA, messages=USER, tools=[WEATHER], stream=True,  # type: ignore[list-item,arg-type]
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                                temperature=0):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == "tool_calls" and calls
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])  # type: ignore[index]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C, clear"}]
    again = client.chat.completions.create(model=LLAMA, messages=history, tools=[WEATHER], tool_choice="none",  # type: ignore[arg-type,list-item]
                                           max_tokens=5, temperature=0)
    assert again.choices[0].message.tool_calls is None and again.usage is not None
    shorter = client.chat.completions.create(model=LLAMA, messages=USER, max_tokens=5, temperature=0)  # type: ignore[arg-type]
    assert shorter.usage is not None and again.usage.prompt_tokens > shorter.usage.prompt_tokens  # history rendered


def test_a_logit_bias_ban_removes_the_token(cluster: E2ECluster) -> None:
    client = cluster.openai()
    plain = client.completions.create(model=LLAMA, prompt="The tide", max_tokens=8, temperature=0, logprobs=0)
    tokens = plain.choices[0].logprobs.tokens  # type: ignore[union-attr]
    banned_text = tokens[0]
    ids = post(cluster, "/tokenize", {"model": LLAMA, "prompt": banned_text, "add_special_tokens": False}).json()
    (banned,) = ids["tokens"]
    biased = client.completions.create(model=LLAMA, prompt="The tide", max_tokens=8, temperature=0, logprobs=0,
                                       logit_bias={str(banned): -100})
    assert banned_text not in biased.choices[0].logprobs.tokens  # type: ignore[union-attr]
    forced = client.completions.create(model=LLAMA, prompt="The tide", max_tokens=3, temperature=1.0, seed=1,
                                       logit_bias={str(banned): 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [banned_text] * 3  # type: ignore[union-attr]


def test_penalties_change_greedy_text_and_are_range_checked(cluster: E2ECluster) -> None:
    client = cluster.openai()
    base = client.completions.create(model=LLAMA, prompt="The tide", max_tokens=24, temperature=0)
    tokens = post(cluster, "/tokenize", {"model": LLAMA, "prompt": base.choices[0].text, "add_special_tokens": False})
    assert len(set(tokens.json()["tokens"])) < 24  # a random model repeats itself: penalties have work to do
    pen = client.completions.create(model=LLAMA, prompt="The tide", max_tokens=24, temperature=0, frequency_penalty=2.0)
    assert pen.choices[0].text != base.choices[0].text
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("min_p", 2)):
        resp = post(cluster, "/v1/completions", {"model": LLAMA, "prompt": "x", field: value})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text


def test_best_of_keeps_the_most_likely(cluster: E2ECluster) -> None:
    got = post(cluster, "/v1/completions", {"model": LLAMA, "prompt": "The tide", "max_tokens": 6, "n": 1,
                                            "best_of": 3, "temperature": 1.0, "seed": 4})
    assert got.status_code == 200 and len(got.json()["choices"]) == 1, got.text
    assert got.json()["usage"]["completion_tokens"] >= 6  # every sample counts
    assert post(cluster, "/v1/completions", {"model": LLAMA, "prompt": "x", "n": 2, "best_of": 1}).status_code == 400


def test_tokenize_round_trips_through_detokenize_and_version(cluster: E2ECluster) -> None:
    text = "The tide comes in, and the tide goes out."
    ids = post(cluster, "/tokenize", {"model": LLAMA, "prompt": text, "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] > 0
    assert post(cluster, "/detokenize", {"model": LLAMA, "tokens": ids["tokens"]}).json() == {"prompt": text}
    chat = post(cluster, "/tokenize", {"model": LLAMA, "messages": USER}).json()
    used = cluster.openai().chat.completions.create(model=LLAMA, messages=USER, max_tokens=1)  # type: ignore[arg-type]
    assert used.usage is not None and chat["count"] == used.usage.prompt_tokens
    version = httpx.get(cluster.base_url + "/version", timeout=10).json()
    assert isinstance(version["version"], str) and version["version"]


# A value for every field of the official client's request types: served, or a 400 naming it.
SAMPLE: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f"}], "logit_bias": {"5": 1.0}, "logprobs": True, "max_completion_tokens": 3,
    "max_tokens": 3, "metadata": {"a": "b"}, "modalities": ["text", "audio"], "moderation": {"x": 1}, "n": 1,
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5,
    "prompt_cache_key": "k", "prompt_cache_options": {"x": 1}, "prompt_cache_retention": "24h",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "u1", "seed": 1,
    "service_tier": "flex", "stop": ["\n\n"], "store": True, "stream_options": {"include_usage": True},
    "temperature": 0.5, "tool_choice": "auto", "tools": [WEATHER], "top_logprobs": 2, "top_p": 0.9, "user": "u1",
    "verbosity": "low", "web_search_options": {}, "best_of": 2, "echo": True, "suffix": "end",
}
REFUSED = {"audio", "function_call", "functions", "metadata", "modalities", "moderation", "prediction",
           "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort", "service_tier",
           "store", "verbosity", "web_search_options", "suffix"}


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_official_field_is_served_or_refused_by_name(cluster: E2ECluster, api: str) -> None:
    params = chat_params.CompletionCreateParamsBase if api == "chat" else completion_params.CompletionCreateParamsBase
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    base: dict[str, Any] = {"model": LLAMA, "max_tokens": 3}
    base.update({"messages": USER} if api == "chat" else {"prompt": "Hi"})
    for field in sorted(typing.get_type_hints(params)):
        if field in ("model", "messages", "prompt"):
            continue
        assert field in SAMPLE, f"the official client has a new field {field!r}: serve it or refuse it"
        body = {**base, field: SAMPLE[field] if (api, field) != ("completions", "logprobs") else 1}
        if field == "stream_options":
            body["stream"] = True
        if field == "top_logprobs":
            body["logprobs"] = True
        if field in ("tool_choice", "parallel_tool_calls"):
            body["tools"] = [WEATHER]
        resp = post(cluster, path, body)
        if field in REFUSED:
            assert resp.status_code == 400 and resp.json()["error"]["param"] == field, (field, resp.text)
        else:
            assert resp.status_code == 200, (field, resp.text)
    unknown = post(cluster, path, {**base, "frobnicate": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "frobnicate", unknown.text


def test_the_openai_client_sees_refusals_as_bad_requests(cluster: E2ECluster) -> None:
    with pytest.raises(openai.BadRequestError, match="suffix"):
        cluster.openai().completions.create(model=LLAMA, prompt="x", suffix="y", max_tokens=2)

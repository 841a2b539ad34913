"""The gateway in a whole cluster: schemathesis against its OpenAPI document, an in-stream error
when a stream's worker dies past the re-dispatch limit, and a drain that lets streams finish.

Two workers serve the llama model; `max_redispatches = 0`, so a worker's death ends its streams
with an error. The tests run in file order and the last one stops the gateway.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_headers_conformance, response_schema_conformance, status_code_conformance,
)

from e2e.assets import LLAMA, LORA, Oracle
from e2e.cluster import ClusterSpec, E2ECluster
from e2e.observer import Observer
from services.gateway.app import openapi_document
from shared.config import load_config

pytestmark = pytest.mark.timeout(240)

CLUSTER_SPEC = ClusterSpec(workers={"w0": [LLAMA], "w1": [LLAMA]}, max_redispatches=0,
                           resident_adapters={"w0": [LORA], "w1": [LORA]})
SCHEMA = schemathesis.openapi.from_dict(openapi_document(load_config()))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
SERVED = (LLAMA, LORA)


def servable(body: Any, pick: int) -> Any:
    """Point about half the generated requests at a served model and keep their generation small, so
    they run on the workers instead of stopping at a 404 or a limit (invalid values stay invalid)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if isinstance(body.get("model"), str) and pick % 2 == 0:
        body["model"] = SERVED[pick % 4 // 2]
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(key), int) and body[key] > 8:
            body[key] = 8
    if "model" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 8  # the default would be the rest of the context
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 2:
        body["prompt"] = body["prompt"][:2]
    return body


@SCHEMA.parametrize()
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_schemathesis_finds_no_server_error_and_no_schema_violation(case: Any, cluster: E2ECluster) -> None:
    case.body = servable(case.body, len(json.dumps(case.body, default=str)) if case.body is not None else 0)
    case.call_and_validate(base_url=cluster.base_url, checks=CHECKS, timeout=60)


def test_the_served_document_is_the_one_tested(cluster: E2ECluster) -> None:
    assert httpx.get(cluster.base_url + "/openapi.json").json() == json.loads(json.dumps(SCHEMA.raw_schema))


def test_prompt_lists_n_and_logprobs_through_the_openai_client(cluster: E2ECluster, oracle: Oracle) -> None:
    prompts = ["The tide comes in and", "Once upon a time"]
    wants = [oracle.greedy(LLAMA, prompt=p, max_tokens=6) for p in prompts]
    got = cluster.openai().completions.create(model=LLAMA, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                              logprobs=2)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for choice in got.choices:
        want = wants[choice.index // 2]  # OpenAI's order: prompt 0's choices, then prompt 1's
        assert choice.text == want.text and choice.logprobs is not None
        assert len(choice.logprobs.tokens) == len(want.token_ids) == len(choice.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs) and len(choice.logprobs.top_logprobs[0]) <= 2
    assert got.usage is not None and got.usage.prompt_tokens == sum(w.prompt_tokens for w in wants)
    assert got.usage.completion_tokens == 2 * sum(len(w.token_ids) for w in wants)

    chat = cluster.openai().chat.completions.create(model=LORA, messages=oracle.chat_messages, max_tokens=5,
                                                    temperature=0, logprobs=True, top_logprobs=2)  # type: ignore[arg-type]
    want = oracle.greedy(LLAMA, messages=oracle.chat_messages, max_tokens=5, adapter=LORA)
    (choice,) = chat.choices
    assert choice.message.content == want.text and choice.logprobs is not None and choice.logprobs.content
    assert len(choice.logprobs.content) == len(want.token_ids)
    assert all(len(entry.top_logprobs) <= 2 for entry in choice.logprobs.content)


async def test_a_worker_death_past_the_redispatch_limit_is_an_in_stream_error(
        cluster: E2ECluster, oracle: Oracle, observer: Observer) -> None:
    (prompt,) = await asyncio.to_thread(oracle.long_prompts, LLAMA, 1, 400)
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
    events: list[str] = []
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:  # tokens are flowing: kill the worker that makes them
                    (rid,) = observer.active()
                    (worker,) = set(observer.workers(rid))
                    cluster.kill(worker)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "redispatch_limit" and set(error) == {"message", "type", "param", "code"}
    text = "".join(json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-2])
    assert oracle.greedy(LLAMA, prompt=prompt, max_tokens=400).text.startswith(text)  # what arrived is valid


async def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_work(cluster: E2ECluster,
                                                                          oracle: Oracle) -> None:
    """Last: the gateway is gone afterwards."""
    (prompt,) = await asyncio.to_thread(oracle.long_prompts, LLAMA, 1, 120)
    want = oracle.greedy(LLAMA, prompt=prompt, max_tokens=120)
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": 120, "temperature": 0, "stream": True}
    gateway = cluster.procs["gateway"].proc
    assert gateway is not None
    text = ""
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.aiter_lines()
            first = await anext(lines)
            text += json.loads(first.removeprefix("data: "))["choices"][0]["text"]
            gateway.send_signal(signal.SIGTERM)
            started = time.monotonic()
            while (ready := await http.get("/ready")).status_code != 503:
                assert time.monotonic() - started < 2
            refused = await http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert ready.json()["status"] == "draining"
            async for line in lines:
                if line.startswith("data: {"):
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"]
                if line:
                    last = line
    assert last == "data: [DONE]" and finish == want.finish_reason and text == want.text
    assert await asyncio.to_thread(gateway.wait, 10) == 0

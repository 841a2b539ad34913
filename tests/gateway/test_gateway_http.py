"""The gateway's HTTP contract with no worker behind it: a real nats-server, registry, dispatcher
and gateway process. Every answer here is decided by the gateway (or the dispatcher's refusal)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from gateway.stack import ADAPTER, MAX_CONTEXT, MODEL, GatewayStack
from shared.events.common import LayerRange
from shared.events.registry import AdapterRecord, InstanceRecord, ModelRecord, WorkerRecord
from shared.events.worker import WorkerHeartbeat, WorkerState
from shared.subjects import worker_heartbeat

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[GatewayStack]:
    running = GatewayStack(tmp_path_factory.mktemp("gw-http"), tokenizer_dir, dispatcher=True).start()
    try:
        yield running
    finally:
        running.stop()


def post(stack: GatewayStack, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(stack.url + path, json=body, timeout=30, **kw) if body is not None else \
        httpx.post(stack.url + path, timeout=30, **kw)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["code"], str) and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


def test_health_is_live_and_the_openapi_document_describes_the_api(stack: GatewayStack) -> None:
    assert httpx.get(stack.url + "/health").json() == {"status": "ok", "detail": ""}
    doc = httpx.get(stack.url + "/openapi.json").json()
    assert {COMPLETIONS, CHAT, "/v1/models", "/health", "/ready", "/metrics"} <= set(doc["paths"])
    post_op = doc["paths"][COMPLETIONS]["post"]
    assert post_op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("CompletionRequest")
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(post_op["responses"])
    assert "text/event-stream" in post_op["responses"]["200"]["content"]
    assert "Retry-After" in post_op["responses"]["429"]["headers"]
    assert set(doc["components"]["schemas"]["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}


def test_models_come_from_the_registry_and_follow_its_changes(stack: GatewayStack) -> None:
    listed = httpx.get(stack.url + "/v1/models").json()
    cards = {card["id"]: card for card in listed["data"]}
    assert listed["object"] == "list" and set(cards) == {MODEL, ADAPTER}
    assert cards[MODEL]["max_model_len"] == MAX_CONTEXT and cards[MODEL]["parent"] is None
    assert cards[ADAPTER]["parent"] == MODEL

    extra = AdapterRecord(name="late-lora", base=MODEL, path="/nowhere", rank=8, targets=["v_proj"])
    stack.run(stack.registry(lambda r: r.create(extra)))
    stack.wait_http(lambda r: "late-lora" in {c["id"] for c in r.json()["data"]}, "/v1/models", timeout=5)

    async def remove(registry: Any) -> None:
        entry = await registry.get("adapters", "late-lora")
        await registry.delete("adapters", "late-lora", entry.revision)

    stack.run(stack.registry(remove))
    stack.wait_http(lambda r: "late-lora" not in {c["id"] for c in r.json()["data"]}, "/v1/models", timeout=5)


def test_ready_needs_a_live_worker_serving_something(stack: GatewayStack) -> None:
    not_ready = httpx.get(stack.url + "/ready")
    assert not_ready.status_code == 503 and not_ready.json()["status"] == "not_ready"
    worker = WorkerRecord(worker_id="w-ready", device="cpu", memory_capacity_bytes=1 << 20, state=WorkerState.READY,
                          last_heartbeat_ts=time.time())
    instance = InstanceRecord(instance_id="i-ready", model=MODEL, worker_id="w-ready",
                              layers=LayerRange(start=0, end=1), state="ready")

    async def publish(registry: Any) -> None:
        await registry.modify("workers", "w-ready", lambda _r: worker)
        await registry.modify("instances", "i-ready", lambda _r: instance)
        await registry.bus.publish(worker_heartbeat(), WorkerHeartbeat(  # one beat, then silence
            worker_id="w-ready", incarnation="w-ready-1", seq=0, ts=time.time(), state=WorkerState.READY))

    stack.run(stack.registry(publish))
    try:
        # No heartbeat follows, so the registry marks the worker dead after 1 s: ready, then not ready again.
        stack.wait_http(lambda r: r.status_code == 200 and r.json()["status"] == "ready", "/ready", timeout=5)
        stack.wait_http(lambda r: r.status_code == 503, "/ready", timeout=10)
    finally:
        async def clean(registry: Any) -> None:
            entry = await registry.get("instances", "i-ready")
            if entry is not None:
                await registry.delete("instances", "i-ready", entry.revision)

        stack.run(stack.registry(clean))


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, b"{", None),  # not JSON
    (COMPLETIONS, b"[1, 2]", None),  # not an object
    (COMPLETIONS, {"model": MODEL}, "prompt"),  # missing
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),  # wrong type
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature"),  # out of range
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 5}, "n"),  # over the config's max_n
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 65}, "max_tokens"),  # over the config's max
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, "x"]}, "prompt"),  # mixed shapes
    (COMPLETIONS, {"model": MODEL, "prompt": [[]]}, "prompt[0]"),  # an empty token list
    (COMPLETIONS, {"model": MODEL, "prompt": [100000]}, "prompt"),  # outside the vocabulary
    (COMPLETIONS, {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    (CHAT, {"model": MODEL, "messages": []}, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages"),  # template refuses
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_requests_are_400_naming_the_parameter(stack: GatewayStack, path: str, body: Any,
                                                   param: str | None) -> None:
    resp = post(stack, path, content=body) if isinstance(body, bytes) else post(stack, path, body)
    error = error_of(resp)
    assert resp.status_code == 400, resp.text
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_request_error", param)
    assert "Traceback" not in resp.text


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"model": MODEL, "prompt": list(range(3, 73)), "max_tokens": 64}, "max_tokens"),  # 70 + 64
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 64,
            "n": 1, "stop": "x", "temperature": 0, "max_tokens": 1}, None),  # fits: not refused by the gateway
    (COMPLETIONS, {"model": ADAPTER, "prompt": list(range(3, 3 + MAX_CONTEXT))}, "prompt"),  # fills the context
    (COMPLETIONS, {"model": MODEL, "prompt": " ".join(["word"] * 150)}, "prompt"),  # over max_prompt_tokens
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 30}], "max_completion_tokens": 60},
     "max_completion_tokens"),  # a 74-token prompt + 60
])
def test_context_length_exceeded(stack: GatewayStack, path: str, body: dict[str, Any], param: str | None) -> None:
    resp = post(stack, path, body)
    error = error_of(resp)
    if param is None:  # a request that fits goes on to the dispatcher (which has no capacity here)
        assert resp.status_code == 503 and error["code"] == "no_capacity"
        return
    assert resp.status_code == 400, resp.text
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)


def test_unknown_models_and_routes_are_404_in_the_openai_shape(stack: GatewayStack) -> None:
    for path, body in ((COMPLETIONS, {"model": "no-such-model", "prompt": "x"}),
                       (CHAT, {"model": "no-such-lora", "messages": [{"role": "user", "content": "x"}]})):
        resp = post(stack, path, body)
        error = error_of(resp)
        assert resp.status_code == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
    missing = httpx.get(stack.url + "/v2/everything")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    wrong = httpx.get(stack.url + COMPLETIONS)
    assert wrong.status_code == 405 and error_of(wrong)["code"] == "method_not_allowed"


def test_a_body_over_the_limit_is_413_declared_or_streamed(stack: GatewayStack) -> None:
    big = b'{"model": "' + b"x" * (17 << 10) + b'", "prompt": "x"}'
    declared = post(stack, COMPLETIONS, content=big)
    assert declared.status_code == 413 and error_of(declared)["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    streamed = post(stack, COMPLETIONS, content=chunks())
    assert streamed.status_code == 413 and error_of(streamed)["code"] == "request_too_large"
    assert post(stack, COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 99}).status_code == 400  # still serving


def test_without_capacity_it_is_503_with_retry_after(stack: GatewayStack) -> None:
    for path, body in ((COMPLETIONS, {"model": MODEL, "prompt": "hello", "max_tokens": 4}),
                       (COMPLETIONS, {"model": ADAPTER, "prompt": ["a", "b"], "n": 2, "stream": True}),
                       (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})):
        resp = post(stack, path, body)
        assert resp.status_code == 503, resp.text
        assert error_of(resp)["code"] == "no_capacity" and int(resp.headers["retry-after"]) >= 1


def test_a_model_whose_tokenizer_cannot_be_loaded_is_503_without_details(stack: GatewayStack) -> None:
    broken = ModelRecord(name="broken-model", path="/nowhere/secret-dir", num_layers=1, max_context=64)
    stack.run(stack.registry(lambda r: r.modify("models", "broken-model", lambda _r: broken)))
    stack.wait_http(lambda r: "broken-model" in {c["id"] for c in r.json()["data"]}, "/v1/models", timeout=5)
    resp = post(stack, COMPLETIONS, {"model": "broken-model", "prompt": "x"})
    assert resp.status_code == 503 and error_of(resp)["code"] == "model_unavailable"
    assert "secret-dir" not in resp.text and "retry-after" in resp.headers


def test_metrics_count_requests_by_route_and_status(stack: GatewayStack) -> None:
    post(stack, COMPLETIONS, {"model": MODEL, "prompt": "x", "n": 99})
    resp = httpx.get(stack.url + "/metrics")
    text = resp.text
    assert resp.headers["content-type"].count("charset") == 1, resp.headers["content-type"]
    assert 'tidal_gateway_requests_total{route="/v1/completions",status="400"}' in text
    assert "tidal_gateway_request_seconds_bucket" in text and "tidal_gateway_inflight_streams" in text

"""API keys, rate limits, the dispatcher's refusals, client disconnects and draining, against a real
gateway process on a real NATS with a real registry. Where a dispatcher would stand, the minimal
`SubmitResponder` answers the real submit protocol (see submit_responder.py)."""
from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import httpx
import pytest

from gateway.stack import MODEL, GatewayStack
from gateway.submit_responder import FAIL, HOLD, SECRET, SubmitResponder

KEYS = [f"sk-gateway-test-{i}" for i in range(8)]
GATEWAY_EXTRA = f"api_keys = {KEYS!r}\n[gateway.rate_limit]\nrequests_per_s = 0.5\nburst = 4\n".replace("'", '"')
COMPLETIONS = "/v1/completions"


def auth(i: int) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[i]}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[GatewayStack]:
    running = GatewayStack(tmp_path_factory.mktemp("gw-edge"), tokenizer_dir, dispatcher=False,
                           gateway_extra=GATEWAY_EXTRA).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
async def responder(stack: GatewayStack) -> AsyncIterator[SubmitResponder]:
    running = await SubmitResponder().start(stack.nats_url)
    try:
        yield running
    finally:
        await running.stop()


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]  # type: ignore[no-any-return]


def test_an_api_key_is_required_everywhere_but_health_and_ready(stack: GatewayStack) -> None:
    assert httpx.get(stack.url + "/health").status_code == 200
    assert httpx.get(stack.url + "/ready").status_code == 503  # not ready (no worker), but not 401
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        for headers in ({}, {"Authorization": "Bearer sk-wrong-key-000"}, {"Authorization": f"Basic {KEYS[0]}"},
                        {"Authorization": f"Bearer {KEYS[0]}x"}):
            resp = httpx.get(stack.url + path, headers=headers)
            assert resp.status_code == 401, (path, headers, resp.text)
            assert error_of(resp)["code"] == "invalid_api_key" and KEYS[0] not in resp.text
    denied = httpx.post(stack.url + COMPLETIONS, content=b"x" * (64 << 10))  # refused before the body is read
    assert denied.status_code == 401
    assert httpx.get(stack.url + "/v1/models", headers=auth(0)).status_code == 200
    doc = httpx.get(stack.url + "/openapi.json", headers=auth(0)).json()
    assert doc["security"] == [{"bearer": []}]


def test_each_key_has_its_own_rate_limit(stack: GatewayStack) -> None:
    statuses = [httpx.get(stack.url + "/v1/models", headers=auth(1)).status_code for _ in range(4)]
    assert statuses == [200] * 4  # the burst
    limited = httpx.get(stack.url + "/v1/models", headers=auth(1))
    assert limited.status_code == 429 and error_of(limited)["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.headers["retry-after"]) <= 2
    assert httpx.get(stack.url + "/v1/models", headers=auth(2)).status_code == 200  # another key is unaffected
    assert httpx.get(stack.url + "/health").status_code == 200  # not rate limited


async def test_without_a_dispatcher_it_is_503(stack: GatewayStack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, headers=auth(3)) as http:
        resp = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 503 and error_of(resp)["code"] == "no_capacity" and "retry-after" in resp.headers


@pytest.mark.parametrize("seed, status, code, param, key", [
    (1, 429, "queue_full", None, 4),
    (2, 503, "no_capacity", None, 4),
    (3, 503, "draining", None, 4),
    (4, 404, "model_not_found", "model", 5),
    (5, 400, "context_length_exceeded", "prompt", 5),
    (FAIL, 500, "internal_error", None, 5),
])
async def test_dispatcher_refusals_map_to_http_errors(stack: GatewayStack, responder: SubmitResponder, seed: int,
                                                      status: int, code: str, param: str | None, key: int) -> None:
    async with httpx.AsyncClient(base_url=stack.url, headers=auth(key)) as http:
        resp = await http.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed})
    error = error_of(resp)
    assert (resp.status_code, error["code"], error["param"]) == (status, code, param), resp.text
    if status in (429, 503):
        assert resp.headers["retry-after"] == "3"  # the dispatcher's 2.5 s, rounded up
    assert SECRET not in resp.text and "10.1.2.3" not in resp.text and "Traceback" not in resp.text


async def test_a_client_that_goes_away_aborts_its_request_at_once(stack: GatewayStack,
                                                                   responder: SubmitResponder) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 8, "seed": HOLD}
    async with httpx.AsyncClient(base_url=stack.url, headers=auth(6), timeout=30) as http:
        async with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            assert len(responder.submits) == 2  # one per prompt, both admitted before the stream began
        gone = time.time()
        for submit in responder.submits:
            at, abort = await responder.wait_abort(submit.request_id)
            assert abort.reason == "client_disconnected" and at - gone < 1.0

        responder.submits.clear()  # not streaming: the same, while the client waits for the whole body
        waiting = asyncio.ensure_future(http.post(COMPLETIONS, json=body))
        while len(responder.submits) < 2:
            await asyncio.sleep(0.01)
        waiting.cancel()
        gone = time.time()
        for submit in responder.submits:
            at, abort = await responder.wait_abort(submit.request_id)
            assert abort.reason == "client_disconnected" and at - gone < 1.0
        metrics = (await http.get("/metrics")).text
    assert 'tidal_gateway_inflight_streams{route="/v1/completions"} 0.0' in metrics
    assert 'tidal_gateway_aborts_total{reason="client_disconnected"} 4.0' in metrics


async def test_sigterm_drains_then_exits_0(stack: GatewayStack, responder: SubmitResponder) -> None:
    """Last in this module: the gateway is gone afterwards."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "seed": HOLD, "stream": True}
    async with httpx.AsyncClient(base_url=stack.url, headers=auth(7), timeout=30) as http:
        async with http.stream("POST", COMPLETIONS, json=body) as resp:
            assert resp.status_code == 200
            proc = stack.gateway.proc
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            assert (await http.get("/health")).json()["status"] == "draining"
            refused = await http.post(COMPLETIONS, json=body)
            assert refused.status_code == 503 and error_of(refused)["code"] == "draining"
            assert "retry-after" in refused.headers
            # The in-flight stream outlives the drain deadline (3 s): it ends with an error event.
            lines = [line async for line in resp.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"code":"draining"' in lines[-2], lines
    (submit,) = [s for s in responder.submits if s.sampling.seed == HOLD]
    _at, abort = await responder.wait_abort(submit.request_id)
    assert abort.reason == "cancelled"
    assert await asyncio.to_thread(proc.wait, 10) == 0

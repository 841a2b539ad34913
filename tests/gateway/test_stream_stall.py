"""The gateway's stream-progress guard (services/gateway/stream_guard.py), against a real gateway
process on a real NATS: a request admitted by the dispatcher that never gets a token or an error
(a request lost somewhere downstream) is ended after `stream_stall_timeout` — streamed: an error
event naming the stall, then `[DONE]`; not streamed: 503 `stream_stalled` — and its sequences are
aborted on the workers. Where the dispatcher would stand, `SubmitResponder` admits and publishes
nothing (seed HOLD)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import AsyncIterator, Iterator

import httpx
import pytest

from gateway.stack import MODEL, GatewayStack
from gateway.submit_responder import HOLD, SubmitResponder

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[GatewayStack]:
    running = GatewayStack(tmp_path_factory.mktemp("gw-stall"), tokenizer_dir, dispatcher=False,
                           limits_extra='stream_stall_timeout = "2s"').start()
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


async def test_a_stream_with_no_progress_ends_with_an_error_and_done(stack: GatewayStack,
                                                                    responder: SubmitResponder) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "seed": HOLD, "stream": True}
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        async with http.stream("POST", COMPLETIONS, json=body) as resp:
            assert resp.status_code == 200
            events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "stream_stalled" and "no progress for 2 s" in error["message"], error
    (submit,) = responder.submits
    _, abort = await responder.wait_abort(submit.request_id)
    assert abort.reason == "cancelled"


async def test_a_collected_answer_with_no_progress_is_503(stack: GatewayStack, responder: SubmitResponder) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "seed": HOLD}
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
        resp = await http.post(COMPLETIONS, json=body)
        metrics = (await http.get("/metrics")).text
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "stream_stalled", resp.text
    assert 'tidal_gateway_stream_anomalies_total{kind="stalled"} 2.0' in metrics
    assert 'tidal_gateway_inflight_streams{route="/v1/completions"} 0.0' in metrics

"""The gateway's fast path: which requests skip Litestar, and that the others reach it intact. No I/O:
the app behind is a plain ASGI function recording what it received."""
from __future__ import annotations

import json
from typing import Any

from services.gateway.catalog import ModelCatalog
from services.gateway.fast_path import FastPath
from services.gateway.state import GatewayState
from shared.config import parse_config

CONFIG = parse_config('[[models]]\nname = "m"\npath = "/models/m"\nmax_context = 64\n')


async def _call(path: str, body: dict[str, Any] | bytes) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Run FastPath with `body`; returns (the bodies the app behind read, what was sent to the client)."""
    state = GatewayState(CONFIG, ModelCatalog(), is_draining=lambda: False)
    seen: list[bytes] = []
    sent: list[dict[str, Any]] = []

    async def litestar(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await FastPath(litestar, state)(scope, receive, send)
    return seen, sent


async def test_non_streaming_undecodable_and_other_routes_reach_litestar_with_their_body() -> None:
    plain = {"model": "m", "prompt": "hi"}
    assert (await _call("/v1/completions", plain))[0] == [json.dumps(plain).encode()]
    lax = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": "5"}  # strict decoding refuses it
    assert (await _call("/v1/completions", lax))[0] == [json.dumps(lax).encode()]
    assert (await _call("/v1/models", b""))[0] == [b""]


async def test_a_body_that_does_not_decode_is_answered_400_before_litestar() -> None:
    seen, sent = await _call("/v1/chat/completions", b"{not json")
    assert seen == [] and sent[0]["status"] == 400
    assert "could not parse the JSON body" in json.loads(sent[1]["body"])["error"]["message"]


async def test_a_streaming_request_is_answered_without_litestar() -> None:
    # No hub (no NATS): the endpoint itself answers 503, in the OpenAI shape, and Litestar never runs.
    seen, sent = await _call("/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
    assert seen == []
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"]

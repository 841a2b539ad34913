"""Malformed bodies, encodings, nesting and content types against the real HTTP stack (nats-server,
registry, dispatcher and the gateway process; no worker): every one is a 4xx in OpenAI's shape
naming the problem, never a 500, and the gateway keeps serving. Then schemathesis, positive and
negative, over every operation of the OpenAPI document the gateway serves."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_headers_conformance, response_schema_conformance, status_code_conformance,
)

from gateway.stack import MODEL, GatewayStack
from services.gateway.app import openapi_document
from shared.config import load_config

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}
DEEP = 100_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[GatewayStack]:
    running = GatewayStack(tmp_path_factory.mktemp("gw-hostile"), tokenizer_dir, dispatcher=True)
    config = running.config.read_text()  # a body limit that lets 10^5-deep nesting (~10 bytes a level) in
    running.config.write_text(config.replace('max_body_bytes = "16KiB"', 'max_body_bytes = "2MiB"'))
    running.start()
    try:
        yield running
    finally:
        running.stop()


def completion(**extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}).encode()


def raw(body: str) -> bytes:
    return body.encode("utf-8")


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


# (what it is, route, body bytes, headers, expected status, words the message must contain)
HOSTILE: list[tuple[str, str, bytes, dict[str, str], int, str]] = [
    ("empty body", COMPLETIONS, b"", JSON, 400, "empty"),
    ("whitespace body", CHAT, b"  \n ", JSON, 400, "empty"),
    ("not JSON", COMPLETIONS, b"model=x&prompt=y", JSON, 400, "parse the JSON"),
    ("trailing garbage", COMPLETIONS, completion() + b"x", JSON, 400, "parse the JSON"),
    ("a UTF-8 BOM", COMPLETIONS, b"\xef\xbb\xbf" + completion(), JSON, 400, "parse the JSON"),
    ("a JSON string", COMPLETIONS, b'"hello"', JSON, 400, "JSON object"),
    ("invalid UTF-8 in the prompt", COMPLETIONS, b'{"model": "%s", "prompt": "a\xff\xfeb"}' % MODEL.encode(),
     JSON, 400, "UTF-8"),
    ("invalid UTF-8 in the model", COMPLETIONS, b'{"model": "m\xc3", "prompt": "hi"}', JSON, 400, "UTF-8"),
    ("overlong UTF-8 in chat content", CHAT,
     b'{"model": "%s", "messages": [{"role": "user", "content": "\xc0\xaf"}]}' % MODEL.encode(), JSON, 400, "UTF-8"),
    ("invalid UTF-8 in a key", COMPLETIONS, b'{"mod\xffel": "x", "prompt": "hi"}', JSON, 400, "UTF-8"),
    ("invalid UTF-8 after a lax value", COMPLETIONS,
     b'{"max_tokens": "2", "model": "%s", "prompt": "\xff"}' % MODEL.encode(), JSON, 400, "UTF-8"),
    ("a lone surrogate escape", COMPLETIONS, raw('{"model": "%s", "prompt": "\\ud800"}' % MODEL), JSON, 400,
     "parse the JSON"),
    ("an unknown field, 10^5 deep", COMPLETIONS,
     raw('{"model": "%s", "prompt": "hi", "junk": %s}' % (MODEL, nested(DEEP))), JSON, 400, "junk"),
    ("10^5-deep arrays in a free-form field", COMPLETIONS,
     raw('{"model": "%s", "prompt": "hi", "guided_json": {"a": %s}}' % (MODEL, nested(DEEP))), JSON, 400,
     "nested too deeply"),
    ("10^5-deep objects in a free-form field", CHAT,
     raw('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "metadata": %s}'
         % (MODEL, '{"a":' * DEEP + "1" + "}" * DEEP)), JSON, 400,
     "nested too deeply"),
    ("10^5-deep arrays as the prompt", COMPLETIONS, raw('{"model": "m", "prompt": %s}' % nested(DEEP)), JSON, 400,
     "prompt"),
    ("10^5-deep arrays as the body", CHAT, raw(nested(DEEP)), JSON, 400, "JSON object"),
    ("10^5-deep adapter body", "/v1/load_lora_adapter", raw('{"x": %s}' % nested(DEEP)), JSON, 400,
     "nested too deeply"),
    ("NaN", COMPLETIONS, raw('{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL), JSON, 400,
     "parse the JSON"),
    ("a number past float", COMPLETIONS, completion()[:-1] + b', "temperature": 1e400}', JSON, 400, "temperature"),
    ("an integer past 64 bits", COMPLETIONS, completion()[:-1] + b', "seed": 99999999999999999999999}', JSON, 400,
     "seed"),
    ("text/plain", COMPLETIONS, completion(), {"content-type": "text/plain"}, 415, "Content-Type"),
    ("a form", CHAT, b"a=b", {"content-type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
    ("multipart", COMPLETIONS, completion(), {"content-type": "multipart/form-data; boundary=x"}, 415,
     "Content-Type"),
    ("text/plain to an adapter route", "/v1/unload_lora_adapter", b'{"lora_name": "x"}',
     {"content-type": "text/plain"}, 415, "Content-Type"),
    ("a NUL in the model", COMPLETIONS, raw('{"model": "a\\u0000b", "prompt": "hi"}'), JSON, 404, "does not exist"),
    ("NATS wildcards in the model", COMPLETIONS, raw('{"model": "a.*.>", "prompt": "hi"}'), JSON, 404,
     "does not exist"),
    ("a model of 10k characters", COMPLETIONS, raw('{"model": "%s", "prompt": "hi"}' % ("m" * 10_000)), JSON, 400,
     "model"),
]


@pytest.mark.parametrize("what, path, body, headers, status, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_body_is_a_4xx_naming_the_problem(stack: GatewayStack, what: str, path: str, body: bytes,
                                                    headers: dict[str, str], status: int, words: str) -> None:
    for stream in (False, True):  # the fast path (streams) and Litestar's path answer alike
        sent = body.replace(b'"hi"', b'"hi", "stream": true') if stream else body
        resp = httpx.post(stack.url + path, content=sent, headers=headers, timeout=30)
        assert resp.status_code == status, (what, resp.status_code, resp.text[:300])
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and words in error["message"], (what, error)
        assert "Traceback" not in resp.text
    assert httpx.get(stack.url + "/health", timeout=10).status_code == 200


def test_json_with_a_charset_or_no_content_type_is_taken(stack: GatewayStack) -> None:
    for headers in ({"content-type": "application/json; charset=utf-8"}, {}, {"content-type": "Application/JSON"}):
        resp = httpx.post(stack.url + COMPLETIONS, content=completion(), headers=headers, timeout=30)
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_capacity", resp.text  # no worker


SCHEMA = schemathesis.openapi.from_dict(openapi_document(load_config()))
# no worker serves anything here, so 503 (documented) is the answer to every valid generation and /ready;
# the test asserts no other 5xx itself
CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@SCHEMA.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_schemathesis_positive_and_negative_finds_no_server_error(case: Any, stack: GatewayStack) -> None:
    response = case.call_and_validate(base_url=stack.url, checks=CHECKS, timeout=30)
    assert response.status_code < 500 or response.status_code == 503, response.text[:300]

"""Bounds of a completions prompt, through the official `openai` client against the real gateway
(nats-server, registry, gateway processes; no worker: every answer here is a refusal).

One prompt's length is bounded by `[gateway.limits] max_prompt_tokens` (100 in this stack) and
the model's context, never by the 128 that bounds a *list* of prompts; that list bound stays.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import openai
import pytest

from gateway.stack import MODEL, GatewayStack


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[openai.OpenAI]:
    running = GatewayStack(tmp_path_factory.mktemp("gw-prompt"), tokenizer_dir, dispatcher=False).start()
    try:
        yield openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    finally:
        running.stop()


def refusal(client: openai.OpenAI, prompt: object, stream: bool = False) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=stream)  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize("stream", [False, True])  # streaming takes the Edge's fast path: same type, same bounds
def test_token_ids_are_bounded_by_max_prompt_tokens_not_by_the_list_bound(client: openai.OpenAI,
                                                                          stream: bool) -> None:
    for length in (129, 300):  # over the 128 prompts of a list; over max_prompt_tokens = 100
        error = refusal(client, [7] * length, stream)
        body = error.body if isinstance(error.body, dict) else {}
        assert error.status_code == 400 and body.get("code") == "context_length_exceeded", error
        assert body.get("param") == "prompt"
        assert f"{length} tokens" in error.message and "max_prompt_tokens" in error.message and "100" in error.message


def test_a_list_of_more_than_128_prompts_is_refused(client: openai.OpenAI) -> None:
    for prompts in (["hello"] * 129, [[7, 8]] * 129):
        error = refusal(client, prompts)
        body = error.body if isinstance(error.body, dict) else {}
        assert error.status_code == 400 and (body.get("code"), body.get("param")) == ("invalid_request_error", "prompt")
        assert "at most 128 prompts" in error.message and "got 129" in error.message

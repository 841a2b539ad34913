"""The serving cluster through the official `openai` client: completions and chat, streaming and
not, two models and an adapter at once, each greedy output equal to the in-process engine's."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from e2e.assets import LLAMA, LORA, MAX_CONTEXT, QWEN, Oracle
from e2e.cluster import E2ECluster
from e2e.observer import Observer

pytestmark = pytest.mark.timeout(240)

PROMPT = "The tide comes in and"


@pytest.mark.parametrize("model", [LLAMA, QWEN, LORA])
def test_completion_equals_the_engine_run_in_process(cluster: E2ECluster, oracle: Oracle, model: str) -> None:
    base, adapter = (LLAMA, LORA) if model == LORA else (model, None)
    want = oracle.greedy(base, prompt=PROMPT, max_tokens=24, adapter=adapter)
    got = cluster.openai().completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_tokens, len(want.token_ids))
    assert got.model == model


def test_the_adapter_changes_the_output(oracle: Oracle) -> None:
    base = oracle.greedy(LLAMA, prompt=PROMPT, max_tokens=24)
    tuned = oracle.greedy(LLAMA, prompt=PROMPT, max_tokens=24, adapter=LORA)
    assert base.token_ids != tuned.token_ids  # so serving the adapter is observable


def test_streamed_completion_with_usage(cluster: E2ECluster, oracle: Oracle) -> None:
    want = oracle.greedy(QWEN, prompt=PROMPT, max_tokens=20)
    stream = cluster.openai().completions.create(model=QWEN, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for event in stream:
        if event.choices:
            text += event.choices[0].text
            finish = event.choices[0].finish_reason or finish
        if event.usage is not None:
            usage = event.usage
    assert text == want.text and finish == want.finish_reason
    assert usage is not None and usage.completion_tokens == len(want.token_ids)
    assert usage.prompt_tokens == want.prompt_tokens


def test_coalesced_chunks_stream_the_same_text_and_logprobs_as_the_whole_answer(cluster: E2ECluster) -> None:
    """The workers coalesce tokens (stream_interval, default 20 ms; the tiny model steps in ~1 ms):
    one SSE event per chunk, carrying several tokens' text and one logprob entry per token."""
    client = cluster.openai()
    whole = client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=48, temperature=0, logprobs=1)
    stream = client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=48, temperature=0, logprobs=1,
                                       stream=True)
    events = [e.choices[0] for e in stream if e.choices]
    sizes = [len(e.logprobs.tokens) for e in events if e.logprobs is not None and e.logprobs.tokens]
    assert sizes[0] == 1 and max(sizes) > 1 and sum(sizes) == 48  # first token alone, later ones together
    assert "".join(e.text for e in events) == whole.choices[0].text
    streamed = [t for e in events if e.logprobs is not None for t in (e.logprobs.tokens or [])]
    lps = [lp for e in events if e.logprobs is not None for lp in (e.logprobs.token_logprobs or [])]
    assert whole.choices[0].logprobs is not None
    assert streamed == whole.choices[0].logprobs.tokens
    assert lps == pytest.approx(whole.choices[0].logprobs.token_logprobs)
    assert events[-1].finish_reason == whole.choices[0].finish_reason == "length"


def test_chat_streaming_and_not(cluster: E2ECluster, oracle: Oracle) -> None:
    messages = oracle.chat_messages
    want = oracle.greedy(LLAMA, messages=messages, max_tokens=16)
    client = cluster.openai()
    reply = client.chat.completions.create(model=LLAMA, messages=messages, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == want.text and reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.prompt_tokens == want.prompt_tokens
    assert reply.choices[0].finish_reason == want.finish_reason
    stream = client.chat.completions.create(model=LLAMA, messages=messages, max_tokens=16, temperature=0,  # type: ignore[arg-type]
                                            stream=True)
    parts = [e.choices[0].delta.content or "" for e in stream if e.choices]
    assert "".join(parts) == want.text


def test_two_models_and_an_adapter_served_at_once(cluster: E2ECluster, oracle: Oracle) -> None:
    jobs = [(m, f"{PROMPT} {i}") for i in range(3) for m in (LLAMA, QWEN, LORA)]
    wants = [oracle.greedy(LLAMA if m == LORA else m, prompt=p, max_tokens=32, adapter=LORA if m == LORA else None)
             for m, p in jobs]
    client = cluster.openai()

    def run(job: tuple[str, str]) -> str:
        model, prompt = job
        return client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(run, jobs))
    assert texts == [w.text for w in wants]


def test_unknown_model_or_adapter_is_404(cluster: E2ECluster) -> None:
    client = cluster.openai()
    for name in ("no-such-model", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model=name, prompt="x", max_tokens=2)
        assert err.value.status_code == 404 and err.value.code == "model_not_found"


def test_prompt_plus_max_tokens_over_the_context_is_400(cluster: E2ECluster, oracle: Oracle) -> None:
    prompt = "tide " * 200
    n = len(oracle.prompt_ids(LLAMA, prompt))
    with pytest.raises(openai.BadRequestError) as err:
        cluster.openai().completions.create(model=LLAMA, prompt=prompt, max_tokens=MAX_CONTEXT - n + 1)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    ok = cluster.openai().completions.create(model=LLAMA, prompt=prompt, max_tokens=2, temperature=0)
    assert ok.usage is not None and ok.usage.prompt_tokens == n


async def test_client_disconnect_frees_the_kv_blocks_within_a_second(cluster: E2ECluster, oracle: Oracle,
                                                                     observer: Observer) -> None:
    max_tokens = 1000
    (prompt,) = await asyncio.to_thread(oracle.long_prompts, QWEN, 1, max_tokens)  # only w0 serves QWEN
    body = {"model": QWEN, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    since = time.time()
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            while not [u for _ts, u in observer.kv_used("w0", since=since) if u > 0]:  # its KV shows in the stats
                line = await asyncio.wait_for(lines.__anext__(), 10)
                assert "finish_reason\": \"length" not in line, "finished before the disconnect"
            (rid,) = observer.active()
        closed = time.time()  # the response is closed: the client has gone
    freed = await observer.wait_for(lambda: [ts for ts, used in observer.kv_used("w0", since=closed) if used == 0],
                                    timeout=5.0)
    assert freed[0] - closed <= 1.0 + 0.25, f"KV freed {freed[0] - closed:.3f}s after the disconnect (stats every 250 ms)"
    final = observer.streams[rid][-1].msg
    assert final.final and getattr(final, "finish_reason", None) == "abort"
    assert len(observer.chunks(rid)) < max_tokens

"""The prefix economy simulator (loadgen/sim/prefix_economy.py) on a short seeded prefix-sharing trace:
every request is served once in every arm; priced at the live arbiter's granularity (per instance) the
cold cache (one-off documents) is always given up before a chat system prompt, unlike LRU, and the chat
prompts stay cached more (hit rate) with a lower TTFT than without caching."""
from __future__ import annotations

import pytest

from loadgen.sim.prefix_economy import ARMS, run_prefix_economy
from loadgen.sim.prefix_trace import PrefixTraceParams, prefix_trace

PARAMS = PrefixTraceParams(seed=3, duration_s=180.0)


@pytest.fixture(scope="module")
def results():  # type: ignore[no-untyped-def]
    return {arm: run_prefix_economy(PARAMS, arm) for arm in ARMS}


def test_every_request_is_served_once_in_every_arm(results) -> None:  # type: ignore[no-untyped-def]
    trace = prefix_trace(PARAMS)
    want = {m: sum(1 for r in trace if r.model == m) for m in ("chat", "rag")}
    for arm, r in results.items():
        assert {m: len(r.ttft[m]) for m in want} == want, arm
        assert all(x > 0 for m in want for x in r.ttft[m])


def test_without_caching_nothing_hits_or_is_released(results) -> None:  # type: ignore[no-untyped-def]
    off = results["off"]
    assert off.hit_rate("chat") == 0.0 and sum(off.released.values()) == 0


def test_priced_releases_cold_documents_before_any_chat_prompt_and_lru_does_not(results) -> None:  # type: ignore
    lru, priced = results["lru"], results["instance"]
    assert priced.released["rag"] > 0  # memory did run short: the cache was bought from
    assert priced.chat_before_rag == 0
    assert lru.chat_before_rag > 0  # recency alone gives up older (hot) prompts before fresh one-off documents
    assert priced.released["chat"] < lru.released["chat"]
    assert priced.hit_rate("chat") > lru.hit_rate("chat") > 0.0


def test_hits_cut_the_chat_ttft(results) -> None:  # type: ignore[no-untyped-def]
    off, priced = results["off"], results["instance"]
    assert priced.p(50, "chat") < off.p(50, "chat")
    assert priced.p(99, "chat") <= results["lru"].p(99, "chat")

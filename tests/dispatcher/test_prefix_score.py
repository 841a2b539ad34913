"""Prefix-aware routing's scoring (pure): cost = weight x uncached prompt tokens + outstanding tokens,
and the router around the configured policy (no match anywhere: the policy's choice, unchanged)."""
from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.events import SamplingParams, SubmitRequest
from shared.policy.routing import InstanceView, LeastOutstandingWork, RequestView
from shared.prefix_hash import block_hashes, prefix_salt
from services.dispatcher.prefix_index import PrefixIndex
from services.dispatcher.prefix_score import PrefixRouter, choose_by_cost, prefix_cost

BS = 16


def inst(iid: str, *, used: int = 0, queued: int = 0, running: int = 0, total: int = 256) -> InstanceView:
    return InstanceView(instance_id=iid, worker_id=f"w-{iid}", model="m", kv_blocks_used=used,
                        kv_blocks_total=total, block_size=BS, queued_prompt_tokens=queued, running_requests=running)


def req(prompt: int) -> RequestView:
    return RequestView(request_id="r", model="m", prompt_tokens=prompt, max_tokens=8)


def submit(rid: str, tokens: list[int]) -> SubmitRequest:
    return SubmitRequest(request_id=rid, model="m", prompt_token_ids=tokens, sampling=SamplingParams(max_tokens=8),
                         arrival_ts=0.0)


views = st.builds(
    lambda i, used, queued, running, total: inst(f"i{i}", used=used, queued=queued, running=running, total=total),
    st.integers(0, 7), st.integers(0, 64), st.integers(0, 2048), st.integers(0, 8), st.integers(1, 256))


@settings(max_examples=300, deadline=None)
@given(st.lists(views, min_size=1, max_size=6, unique_by=lambda v: v.instance_id), st.integers(1, 2048),
       st.floats(0.0, 10.0))
def test_with_no_match_the_choice_is_the_least_load_choice(instances, prompt, weight) -> None:
    assert choose_by_cost(req(prompt), instances, {}, weight) == LeastOutstandingWork().choose(req(prompt), instances, 0.0)


@settings(max_examples=300, deadline=None)
@given(st.lists(views, min_size=1, max_size=6, unique_by=lambda v: v.instance_id), st.integers(1, 2048),
       st.integers(1, 40), st.data())
def test_the_router_with_nothing_held_chooses_as_its_policy(instances, prompt, layers, data) -> None:
    """Whatever the instances' layers (the cost's KV unit), no match anywhere: the configured policy's choice."""
    instances = [msgspec.structs.replace(v, layers=(0, layers)) for v in instances]
    tokens = data.draw(st.lists(st.integers(0, 1000), min_size=prompt, max_size=prompt))
    router = PrefixRouter(LeastOutstandingWork(), PrefixIndex())
    expected = LeastOutstandingWork().choose(req(prompt), instances, 0.0)
    assert router.choose(submit("r", tokens), req(prompt), instances, 0.0) == expected
    assert router.counts["load"] == 1 and not router.counts["prefix"]


@settings(max_examples=300, deadline=None)
@given(st.lists(views, min_size=2, max_size=6, unique_by=lambda v: v.instance_id), st.integers(16, 2048),
       st.data())
def test_the_choice_is_never_costlier_than_another_eligible_instance(instances, prompt, data) -> None:
    matches = {v.instance_id: data.draw(st.integers(0, prompt // BS)) for v in instances}
    chosen = choose_by_cost(req(prompt), instances, matches, 1.0)
    eligible = [v for v in instances if v.kv_tokens_total >= prompt]
    assert (chosen is None) == (not eligible)
    if chosen is not None:
        cost = {v.instance_id: prefix_cost(prompt, matches[v.instance_id], v, 1.0) for v in eligible}
        assert cost[chosen] == min(cost.values())


def test_the_kv_term_counts_tokens_not_per_layer_blocks() -> None:
    a = msgspec.structs.replace(inst("a", used=30), layers=(0, 30))  # 30 per-layer blocks: one block of tokens
    assert prefix_cost(100, 0, a, 1.0) == 100 + 16
    assert prefix_cost(100, 2, a, 2.0) == 2 * (100 - 32) + 16


def test_a_held_prefix_beats_a_little_less_load_but_not_a_lot() -> None:
    holder, idle = inst("a", used=4), inst("b")  # the holder has 64 tokens of KV in use
    assert choose_by_cost(req(512), [holder, idle], {"a": 30}, 1.0) == "a"  # 480 tokens of prefill saved
    busy = inst("a", used=40)  # 640 tokens of work queued there: more than the 480 saved
    assert choose_by_cost(req(512), [busy, idle], {"a": 30}, 1.0) == "b"
    assert choose_by_cost(req(512), [busy, idle], {"a": 30}, 2.0) == "a"  # a heavier weight on the prefill


def test_the_router_follows_summaries_and_its_own_routing() -> None:
    index = PrefixIndex(max_age_s=10.0, predict_s=5.0)
    router = PrefixRouter(LeastOutstandingWork(), index)
    system = list(range(100, 100 + 8 * BS))  # an 8-block shared system prompt
    a, b = inst("a"), inst("b", used=1)  # a is the least loaded
    first = router.choose(submit("r1", system + [1, 2, 3]), req(8 * BS + 3), [b, a], 0.0)
    assert first == "a" and router.counts["load"] == 1  # nothing held anywhere: the policy's choice
    # a is now busier than b, but holds the prefix (predicted from our own routing)
    a2 = inst("a", used=3)
    assert router.choose(submit("r2", system + [4, 5]), req(8 * BS + 2), [b, a2], 1.0) == "a"
    assert router.counts["prefix"] == 1
    # after the prediction lapsed and with no summary, load decides again
    assert router.choose(submit("r3", system + [6]), req(8 * BS + 1), [b, a2], 7.0) == "b"


def test_a_match_counts_leading_blocks_only() -> None:
    index = PrefixIndex(predict_s=5.0)
    salt = prefix_salt("m", None)
    hashes = block_hashes(list(range(4 * BS)), BS, salt)
    index.predict("a", [hashes[0], hashes[2], hashes[3]], 0.0)
    assert index.match("a", hashes, 1.0) == 1  # the chain breaks at block 1
    assert index.match("b", hashes, 1.0) == 0

"""The routing-policy interface and its first policies (pure: no I/O)."""
from __future__ import annotations

import pytest

from shared.policy.routing import HashRandom, InstanceView, LeastOutstandingWork, RequestView, RoutingPolicy
from shared.policy.routing_policies import make_policy


def inst(iid: str, *, model: str = "m", used: int = 0, queued: int = 0, running: int = 0,
         live: bool = True, total: int = 100) -> InstanceView:
    return InstanceView(instance_id=iid, worker_id=f"w-{iid}", model=model, live=live, kv_blocks_used=used,
                        kv_blocks_total=total, block_size=16, queued_prompt_tokens=queued, running_requests=running)


REQ = RequestView(request_id="r1", model="m", prompt_tokens=100, max_tokens=50)


def test_policies_satisfy_the_protocol() -> None:
    assert isinstance(LeastOutstandingWork(), RoutingPolicy)
    assert isinstance(HashRandom(3), RoutingPolicy)
    assert make_policy("least-load").name == "least-load"
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")


def test_least_load_counts_kv_and_queued_prompt_tokens() -> None:
    # a: 10 blocks * 16 = 160 tokens; b: 0 KV but 200 queued prompt tokens; c: 5*16 + 50 = 130
    views = [inst("a", used=10), inst("b", queued=200), inst("c", used=5, queued=50)]
    assert LeastOutstandingWork().choose(REQ, views, now=0.0) == "c"


def test_least_load_skips_dead_other_models_and_too_small_instances() -> None:
    views = [
        inst("a", live=False),
        inst("b", model="other"),
        inst("c", total=5),  # 5 blocks * 16 = 80 tokens < 100-token prompt: can never hold it
        inst("d", used=90),
    ]
    assert LeastOutstandingWork().choose(REQ, views, now=0.0) == "d"


def test_no_capacity_is_none() -> None:
    assert LeastOutstandingWork().choose(REQ, [], now=0.0) is None
    assert LeastOutstandingWork().choose(REQ, [inst("a", live=False), inst("b", model="x")], now=0.0) is None
    assert HashRandom().choose(REQ, [inst("a", live=False)], now=0.0) is None


def test_ties_break_on_running_then_instance_id_regardless_of_order() -> None:
    views = [inst("b", used=4, running=1), inst("c", used=4, running=0), inst("a", used=4, running=1)]
    policy = LeastOutstandingWork()
    assert policy.choose(REQ, views, now=0.0) == "c"
    views = [inst("b", used=4), inst("a", used=4)]
    assert policy.choose(REQ, views, now=0.0) == "a"
    assert policy.choose(REQ, list(reversed(views)), now=0.0) == "a"


def test_hash_random_is_reproducible_and_spreads() -> None:
    views = [inst(c) for c in "abcd"]
    a, b = HashRandom(seed=1), HashRandom(seed=1)
    picks = [a.choose(RequestView(request_id=f"r{i}", model="m", prompt_tokens=1, max_tokens=1), views, 0.0)
             for i in range(400)]
    again = [b.choose(RequestView(request_id=f"r{i}", model="m", prompt_tokens=1, max_tokens=1),
                      list(reversed(views)), 0.0) for i in range(400)]
    assert picks == again  # same seed, same choices, whatever the list order
    counts = {c: picks.count(c) for c in "abcd"}
    assert all(60 < n < 140 for n in counts.values()), counts
    other = [HashRandom(seed=2).choose(RequestView(request_id=f"r{i}", model="m", prompt_tokens=1, max_tokens=1),
                                       views, 0.0) for i in range(400)]
    assert other != picks


def test_views_are_frozen_values() -> None:
    view = inst("a", used=2, queued=7)
    assert view.outstanding_tokens == 2 * 16 + 7
    with pytest.raises(AttributeError):
        view.kv_blocks_used = 3  # type: ignore[misc]

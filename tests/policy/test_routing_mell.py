"""The `mell` routing policy (pure): a request goes to the worker the planner's placement hint names for
its KV size class when the hint is fresh and the instance live with room; otherwise least load, with
the reason counted."""
from __future__ import annotations

import pytest

from shared.events.plan import PlacementEntry, PlacementHints
from shared.policy.routing import InstanceView, RequestView
from shared.policy.routing_policies import make_policy
from shared.policy.routing_mell import MellRouting, entry_for, hinted_choice, prompt_kv_bytes

BLOCK_TOKENS = 16
BYTES_PER_TOKEN = 1000
C = 800_000  # MELL's capacity: 800 tokens


def inst(worker: str, used_blocks: int = 0, *, model: str = "m", live: bool = True, block_bytes: int = 16_000,
         running: int = 0) -> InstanceView:
    return InstanceView(instance_id=f"{worker}-{model}", worker_id=worker, model=model, live=live,
                        kv_blocks_used=used_blocks, kv_blocks_total=50, block_size=BLOCK_TOKENS,
                        running_requests=running, kv_block_bytes=block_bytes)


def req(prompt_tokens: int, model: str = "m") -> RequestView:
    return RequestView(request_id=f"r{prompt_tokens}", model=model, prompt_tokens=prompt_tokens, max_tokens=16)


def hints(now: float = 0.0, *, model: str = "m", ttl: float = 3.0, **workers: str | None) -> PlacementHints:
    """Bounds of C = 800 000 bytes; `workers`: class -> worker id (absent: None)."""
    cuts = [0, C // 8, C // 4, C // 3, C // 2, C]
    names = ["tiny", "T", "S", "M", "L"]
    entries = [PlacementEntry(request_class=n, lower_bytes=lo, upper_bytes=hi, worker_id=workers.get(n),
                              room_bytes=C // 2) for n, lo, hi in zip(names, cuts, cuts[1:])]
    return PlacementHints(model=model, ts=now, capacity_bytes=C, entries=entries, valid_until=now + ttl)


CLUSTER = [inst("w0", 10, running=2), inst("w1", 0), inst("w2", 30, running=3)]


def test_each_size_class_goes_to_its_hinted_worker() -> None:
    h = hints(M="w2", tiny="w0", L="w1")
    # 50 tokens x 1000 B = 50 kB <= C/8: tiny; 300 tokens = 300 kB in (C/3, C/2]: M
    assert hinted_choice(req(50), CLUSTER, h, 1.0) == ("w0-m", "hinted")
    assert hinted_choice(req(300), CLUSTER, h, 1.0) == ("w2-m", "hinted")
    assert prompt_kv_bytes(req(300), CLUSTER) == 300_000
    # a prompt beyond MELL's capacity is an L request; an empty prompt the smallest class
    assert entry_for(h, 2 * C).request_class == "L" and entry_for(h, 0).request_class == "tiny"


def test_fallbacks_are_least_load_and_counted() -> None:
    policy = MellRouting()
    least = make_policy("least-load").choose(req(300), CLUSTER, 0.0)
    assert least == "w1-m"
    assert policy.choose(req(300), CLUSTER, 0.0) == least  # no hints yet
    policy.take_hints(hints(0.0, M="w2", S=None))
    assert policy.choose(req(300), CLUSTER, 1.0) == "w2-m"
    assert policy.choose(req(220), CLUSTER, 1.0) == least  # S: MELL would open a new device -> least load
    assert policy.choose(req(300), CLUSTER, 10.0) == least  # the hint is stale (valid 3 s)
    assert policy.counts == {"no_hint": 1, "hinted": 1, "unplaced": 1, "stale": 1}


@pytest.mark.parametrize("instances, why", [
    ([inst("w0"), inst("w2", live=False)], "unavailable"),  # the hinted worker is not live
    ([inst("w0"), inst("w2", model="other")], "unavailable"),  # ... or has no instance of the model
    ([inst("w0"), inst("w2", 45, running=4)], "no_room"),  # 5 free blocks = 80 tokens < 300
    ([inst("w0", block_bytes=0), inst("w2", block_bytes=0)], "no_kv_size"),  # KV bytes per token unknown
])
def test_a_hint_that_cannot_apply_falls_back(instances: list[InstanceView], why: str) -> None:
    assert hinted_choice(req(300), instances, hints(M="w2"), 0.0) == (None, why)


def test_a_request_larger_than_mells_room_on_the_worker_falls_back() -> None:
    h = hints(L="w1")  # room_bytes = C/2 = 400 kB, an L request of 500 kB does not fit MELL's plan there
    assert hinted_choice(req(500), CLUSTER, h, 0.0) == (None, "no_room")


def test_older_hints_do_not_replace_newer_ones_and_models_are_apart() -> None:
    policy = MellRouting()
    assert policy.take_hints(hints(5.0, M="w2"))
    assert not policy.take_hints(hints(4.0, M="w0"))
    assert policy.take_hints(hints(4.0, model="other", M="w0"))
    assert policy.hints["m"].ts == 5.0 and set(policy.hints) == {"m", "other"}
    assert policy.choose(req(300), CLUSTER, 6.0) == "w2-m"
    assert hinted_choice(req(300), CLUSTER, hints(M="w2", model="other"), 0.0) == (None, "no_hint")


def test_mell_is_a_named_routing_policy() -> None:
    assert isinstance(make_policy("mell"), MellRouting)

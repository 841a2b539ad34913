"""The admission gate (shared/policy/admission.py) and the bounded admission queue (pure)."""
from __future__ import annotations

import pytest
from dispatcher.dispatch_builders import submit

from shared.policy.admission import has_room, serving, with_room
from shared.policy.routing import InstanceView, RequestView
from services.dispatcher.admission_queue import AdmissionQueues
from services.dispatcher.tracked import TrackedRequest


def inst(iid: str, *, running: int = 0, waiting: int = 0, used: int = 0, total: int = 10, queued: int = 0,
         adapters: frozenset[str] = frozenset(), model: str = "m", max_batch: int = 4) -> InstanceView:
    return InstanceView(instance_id=iid, worker_id=f"w-{iid}", model=model, kv_blocks_used=used,
                        kv_blocks_total=total, block_size=16, queued_prompt_tokens=queued, running_requests=running,
                        waiting_requests=waiting, resident_adapters=adapters, max_batch=max_batch)


def req(prompt: int = 32, adapter: str | None = None) -> RequestView:
    return RequestView(request_id="r", model="m", prompt_tokens=prompt, max_tokens=8, adapter=adapter)


def test_room_needs_a_free_batch_slot_and_kv_for_the_prompt() -> None:
    assert has_room(req(), inst("a"))
    assert not has_room(req(), inst("a", running=3, waiting=1))  # max batch 4 reached
    assert has_room(req(prompt=32), inst("a", running=1, used=8))  # 160 - 128 = 32 free tokens
    assert not has_room(req(prompt=33), inst("a", running=1, used=8))
    assert not has_room(req(prompt=33), inst("a", running=1, used=6, queued=32))  # queued prompts count too
    assert has_room(req(prompt=150), inst("a"))  # idle: anything the instance can ever hold goes


def test_serving_filters_model_liveness_size_and_prefers_resident_adapters() -> None:
    views = [inst("a"), inst("b", model="other"), inst("c", total=1), inst("d", adapters=frozenset({"x"}))]
    assert [v.instance_id for v in serving(req(), views)] == ["a", "d"]
    assert [v.instance_id for v in serving(req(adapter="x"), views)] == ["d"]
    assert [v.instance_id for v in serving(req(adapter="y"), views)] == ["a", "d"]  # nobody has it: anyone may load it
    full_d = [inst("a"), inst("d", running=4, adapters=frozenset({"x"}))]
    assert with_room(req(adapter="x"), full_d) == []  # the holder is full: wait for it rather than go cold


def tracked(rid: str, priority: int = 0, prompt: int = 8, redispatched: bool = False) -> TrackedRequest:
    t = TrackedRequest(submit=submit(rid, priority=priority, prompt=prompt), admitted_ts=0.0)
    t.redispatched = redispatched
    return t


def test_queue_orders_redispatches_then_priority_then_arrival() -> None:
    q = AdmissionQueues(bound=8)
    for t in (tracked("a"), tracked("b", priority=3), tracked("c"), tracked("d", redispatched=True)):
        q.push(t)
    assert q.in_order("m") == ["d", "b", "a", "c"]
    assert [q.position(r) for r in "dbac"] == [1, 2, 3, 4]
    assert q.size("m") == 4 and q.queued_prompt_tokens("m") == 32


def test_queue_removal_and_bound() -> None:
    q = AdmissionQueues(bound=2)
    a, b = tracked("a", prompt=5), tracked("b", prompt=7)
    q.push(a)
    assert not q.full("m")
    q.push(b)
    assert q.full("m") and len(q) == 2
    assert q.remove(a) and not q.remove(a)
    assert q.in_order("m") == ["b"] and q.queued_prompt_tokens("m") == 7 and "a" not in q
    q.remove(b)
    assert q.models() == [] and q.in_order("m") == [] and q.position("b") == 0
    with pytest.raises(ValueError):
        AdmissionQueues(bound=0)


def test_lazy_removal_stays_bounded() -> None:
    q = AdmissionQueues(bound=10_000)
    keep = tracked("keep")
    q.push(keep)
    for i in range(1000):
        t = tracked(f"r{i}")
        q.push(t)
        q.remove(t)
    assert len(q._heaps["m"]) < 200 and q.in_order("m") == ["keep"]

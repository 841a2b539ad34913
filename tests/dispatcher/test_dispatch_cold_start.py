"""Scale from zero in the dispatcher core (pure): a request for a model no live instance serves is
queued (bounded: 503-style `no_capacity` past the bound), the planner is asked for capacity (again
while it stays cold), and the queue is dispatched when an instance registers."""
from __future__ import annotations

import msgspec

from dispatcher.dispatch_builders import (
    CONFIG, DEAD_AFTER, core, heartbeat, instance, sends, stats, submit, two_workers,
)

from shared.events import SubmitAccepted, SubmitRejected
from shared.policy.routing_policies import make_policy
from services.dispatcher.cold_start import ASK_EVERY_S, RequestCapacity
from services.dispatcher.core import DispatchCore
from services.dispatcher.model_catalog import ModelCatalog


def cold_core(queue_bound: int = 2) -> DispatchCore:
    return DispatchCore(
        dispatcher_id="dispatcher-test", policy=make_policy("least-load"), catalog=ModelCatalog.from_config(CONFIG),
        queue_bound=queue_bound, max_redispatches=2, dead_after=DEAD_AFTER, block_size=16, max_batch=2, now=0.0,
        scale_from_zero=True,
    )


def asks(effects: list) -> list[RequestCapacity]:
    return [e for e in effects if isinstance(e, RequestCapacity)]


def test_a_cold_model_is_queued_the_planner_asked_and_the_queue_served_when_an_instance_registers() -> None:
    c = cold_core()
    two_workers(c, now=1.0)  # they serve "m"; "q" is in the catalog with no instance
    reply, effects = c.submit(submit("a", model="q"), 1.0)
    assert isinstance(reply, SubmitAccepted) and reply.queue_position == 1 and not sends(effects)
    (ask,) = asks(effects)
    assert (ask.model, ask.queued_requests, ask.queued_prompt_tokens) == ("q", 1, 8)
    reply, effects = c.submit(submit("b", model="q"), 1.1)
    assert isinstance(reply, SubmitAccepted) and reply.queue_position == 2 and asks(effects) == []  # asked already
    # past the bound: no_capacity (the gateway's 503) with a Retry-After, not queue_full (429)
    reply, _ = c.submit(submit("c", model="q"), 1.2)
    assert isinstance(reply, SubmitRejected) and reply.reason == "no_capacity" and reply.retry_after_s
    assert "wait for one to start" in reply.message
    # still cold after ASK_EVERY_S: asked again, with the queue as it is
    (again,) = asks(c.tick(1.0 + ASK_EVERY_S))
    assert again.queued_requests == 2
    # the planner's instance registers: both queued requests go to it, in order
    c.heartbeat(heartbeat("w2"), 3.5)
    effects = c.worker_stats(stats("w2", instance("i-q", model="q")), 3.5)
    assert [(s.assignment.request_id, s.assignment.instance_id) for s in sends(effects)] == [("a", "i-q"), ("b", "i-q")]
    assert asks(c.tick(3.6)) == []


def test_an_instance_being_evicted_is_not_routed_to_and_its_model_counts_as_cold() -> None:
    c = cold_core()
    c.heartbeat(heartbeat("w0"), 0.0)
    evicting = msgspec.structs.replace(instance("i0"), accepting=False)
    c.worker_stats(stats("w0", evicting), 0.0)
    reply, effects = c.submit(submit("a"), 0.1)
    assert isinstance(reply, SubmitAccepted) and not sends(effects) and [a.model for a in asks(effects)] == ["m"]


def test_without_scale_from_zero_a_cold_model_is_refused_at_once() -> None:
    c = core()
    two_workers(c, now=1.0)
    reply, effects = c.submit(submit("a", model="q"), 1.0)
    assert isinstance(reply, SubmitRejected) and reply.reason == "no_capacity" and effects == []


def test_a_later_cold_spell_is_timed_afresh_not_from_an_earlier_one() -> None:
    """A model scaled to zero, started, drained and scaled to zero again: its new queued request gets the whole
    grace, not what was left of the first spell's (the autoscaler scales idle models to zero within seconds)."""
    from services.dispatcher.queue_expiry import NO_INSTANCE_GRACE_S

    c = cold_core()
    two_workers(c, now=1.0)
    c.submit(submit("a", model="q"), 1.0)
    c.tick(1.5)  # q is queued with no instance: its cold spell starts
    c.heartbeat(heartbeat("w2"), 3.0)
    assert sends(c.worker_stats(stats("w2", instance("i-q", model="q")), 3.0))  # served: the spell is over
    c.tick(3.5)
    c.heartbeat(heartbeat("w2"), 5.0)
    c.worker_stats(stats("w2"), 5.0)  # q's instance is gone again
    later = 1.5 + NO_INSTANCE_GRACE_S + 1.0
    c.heartbeat(heartbeat("w0"), later)
    c.heartbeat(heartbeat("w1"), later)
    reply, _ = c.submit(submit("b", model="q"), later)
    assert isinstance(reply, SubmitAccepted)
    failed = [e for e in c.tick(later + 0.1) if type(e).__name__ == "PublishStreamError"]
    assert failed == []

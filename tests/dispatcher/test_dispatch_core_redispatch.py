"""Re-dispatch when a worker dies: resume tokens, seq continuation, limits (pure core, time passed in)."""
from __future__ import annotations

from dispatcher.dispatch_builders import DEAD_AFTER, chunk, core, heartbeat, instance, sends, stats, submit, two_workers

from shared.events import (
    AssignAccepted, Bucket, CatalogChanged, StreamError, TokenChunk, WorkerRecord, WorkerState,
)
from services.dispatcher.core import MAX_ASSIGN_TIMEOUTS
from services.dispatcher.effects import AssignFailed, PublishAbort, PublishFence, PublishStreamError
from services.dispatcher.tracked import Phase


def running_on(c, rid: str, now: float = 0.1):  # type: ignore[no-untyped-def]
    (send,) = sends(c.submit(submit(rid), now)[1])
    a = send.assignment
    c.assign_outcome(rid, a.idempotency_key, AssignAccepted(request_id=rid, worker_id=send.worker_id,
                                                            instance_id=a.instance_id), now)
    return send.worker_id


def keep_alive(c, now: float, *workers: str) -> None:  # type: ignore[no-untyped-def]
    for worker in workers:
        c.heartbeat(heartbeat(worker), now)


def test_silent_worker_requests_resume_elsewhere_with_the_tokens_already_sent() -> None:
    c = core(max_batch=4)
    two_workers(c)
    w = running_on(c, "a")
    other = "w1" if w == "w0" else "w0"
    c.stream(chunk("a", 0, [11], w), 0.2)
    c.stream(chunk("a", 2, [13, 14], w), 0.3)  # out of order: seq 1 not here yet
    c.stream(chunk("a", 1, [12], w), 0.3)
    c.stream(chunk("a", 1, [12], w), 0.3)  # a duplicate changes nothing
    keep_alive(c, 2.0, other)
    c.worker_stats(stats(other, instance("i1" if other == "w1" else "i0")), 2.0)
    assert c.tick(2.9) == []  # w silent for 2.9 s < dead_after
    keep_alive(c, 3.0, other)
    effects = c.tick(DEAD_AFTER + 0.01)
    (send,) = sends(effects)
    a = send.assignment
    assert send.worker_id == other and a.attempt == 1 and a.idempotency_key == "a:1"
    # the fence goes out first: from seq 3 on the stream is attempt 1's
    fence = effects[0]
    assert isinstance(fence, PublishFence) and (fence.fence.attempt, fence.fence.from_seq) == (1, 3)
    assert a.resume_token_ids == [11, 12, 13, 14] and a.next_seq == 3
    assert a.prompt_token_ids == submit("a").prompt_token_ids
    assert c.records[-1].resumed_tokens == 4 and c.records[-1].attempt == 1
    # the dead worker's late chunks are ignored (and it is told, once, to stop that copy); the new
    # worker's continue the stream
    (stop,) = c.stream(chunk("a", 3, [99], w), 3.1)
    assert isinstance(stop, PublishAbort) and stop.abort.worker_id == w and stop.abort.attempt == 1
    assert stop.abort.stops(w, 0, 0) and not stop.abort.stops(w, 1, 0) and not stop.abort.stops(other, 0, 0)
    assert c.stream(chunk("a", 4, [98], w), 3.1) == []
    assert c.requests["a"].next_seq == 3
    c.stream(chunk("a", 3, [15], other, attempt=1), 3.1)
    assert c.requests["a"].emitted == [11, 12, 13, 14, 15] and c.requests["a"].phase is Phase.RUNNING
    c.stream(chunk("a", 4, [16], other, final=True, attempt=1), 3.2)
    assert "a" not in c.requests


def test_registry_dead_record_triggers_redispatch_at_once() -> None:
    c = core(max_batch=4)
    two_workers(c)
    w = running_on(c, "a")
    dead = WorkerRecord(worker_id=w, device="cpu", memory_capacity_bytes=1, state=WorkerState.DEAD,
                        incarnation="inc-1")
    effects = c.catalog_changed(CatalogChanged(bucket=Bucket.WORKERS, key=w, revision=9, op="put", record=dead,
                                               ts=0.0), 0.5)
    (send,) = sends(effects)
    assert send.worker_id != w and send.assignment.attempt == 1
    # a record about an older incarnation than the one we hear is ignored
    w2 = send.worker_id
    c.assign_outcome("a", "a:1", AssignAccepted(request_id="a", worker_id=w2, instance_id="x"), 0.6)
    old = WorkerRecord(worker_id=w2, device="cpu", memory_capacity_bytes=1, state=WorkerState.DEAD,
                       incarnation="inc-0")
    assert c.catalog_changed(CatalogChanged(bucket=Bucket.WORKERS, key=w2, revision=3, op="put", record=old,
                                            ts=0.0), 0.7) == []
    assert c.requests["a"].worker_id == w2


def test_a_restarted_worker_loses_only_the_old_incarnations_requests() -> None:
    c = core(max_batch=4)
    c.heartbeat(heartbeat("w0", "inc-1"), 0.0)
    c.worker_stats(stats("w0", instance("i0")), 0.0)
    running_on(c, "a")
    c.heartbeat(heartbeat("w1", "inc-1"), 0.0)
    c.worker_stats(stats("w1", instance("i1", used=50)), 0.0)  # busier: a new request prefers w0
    effects = c.heartbeat(heartbeat("w0", "inc-2"), 0.5)  # w0 restarted: "a" is gone with the old process
    (send,) = sends(effects)
    assert send.worker_id == "w1" and send.assignment.attempt == 1
    c.worker_stats(stats("w0", instance("i0")), 0.6)
    (send,) = sends(c.submit(submit("b"), 0.7)[1])
    assert send.worker_id == "w0" and c.requests["b"].incarnation == "inc-2"
    assert c.heartbeat(heartbeat("w0", "inc-2"), 0.8) == []


def test_past_the_limit_the_stream_ends_with_redispatch_limit() -> None:
    c = core(max_batch=4, max_redispatches=1)
    two_workers(c)
    w = running_on(c, "a")
    c.stream(chunk("a", 0, [7, 8], w), 0.2)
    (send,) = sends(c.heartbeat(heartbeat(w, "inc-9"), 0.3))  # restart: first re-dispatch
    c.assign_outcome("a", "a:1", AssignAccepted(request_id="a", worker_id=send.worker_id, instance_id="x"), 0.4)
    (effect,) = c.heartbeat(heartbeat(send.worker_id, "inc-9"), 0.5)  # that one restarts too
    assert isinstance(effect, PublishStreamError)
    err = effect.error
    assert isinstance(err, StreamError) and err.code == "redispatch_limit" and err.seq == 1
    assert err.usage is not None and err.usage.completion_tokens == 2
    assert "a" not in c.requests


def test_no_other_instance_queues_the_redispatch_first_in_line() -> None:
    c = core(max_batch=1)
    c.heartbeat(heartbeat("w0"), 0.0)
    c.worker_stats(stats("w0", instance("i0")), 0.0)
    c.heartbeat(heartbeat("w1"), 0.0)
    c.worker_stats(stats("w1", instance("i1")), 0.0)
    running_on(c, "a")
    w_b = running_on(c, "b")
    c.submit(submit("c"), 0.2)  # queued: both instances are full
    w_a = c.requests["a"].worker_id
    effects = c.heartbeat(heartbeat(w_a, "inc-2"), 0.3)  # a's worker restarted (back, but empty)
    assert sends(effects) == []  # its instances are unknown until its next stats
    assert c.queues.in_order("m") == ["a", "c"]  # the re-dispatch goes before the new request
    (send,) = sends(c.worker_stats(stats(w_a, instance("i0" if w_a == "w0" else "i1")), 0.4))
    assert send.assignment.request_id == "a" and send.assignment.attempt == 1
    assert w_b != w_a


def test_lost_assignment_replies_are_retried_with_the_same_key_then_redispatched() -> None:
    c = core(max_batch=4)
    two_workers(c)
    (send,) = sends(c.submit(submit("a"), 0.1)[1])
    key = send.assignment.idempotency_key
    for n in range(1, MAX_ASSIGN_TIMEOUTS):
        (again,) = c.assign_outcome("a", key, AssignFailed("timeout"), 0.1 + n / 10)
        assert again.worker_id == send.worker_id and again.assignment.idempotency_key == key
    (moved,) = sends(c.assign_outcome("a", key, AssignFailed("timeout"), 1.0))
    assert moved.worker_id != send.worker_id and moved.assignment.attempt == 1


def test_no_responders_means_not_taken_and_another_instance_is_tried() -> None:
    c = core(max_batch=4)
    two_workers(c)
    (send,) = sends(c.submit(submit("a"), 0.1)[1])
    (other,) = sends(c.assign_outcome("a", send.assignment.idempotency_key, AssignFailed("no_responders"), 0.2))
    assert other.worker_id != send.worker_id and other.assignment.attempt == 0  # same attempt: it never ran


def test_a_stream_error_or_abort_forgets_the_request() -> None:
    c = core(max_batch=4)
    two_workers(c)
    w = running_on(c, "a")
    c.stream(StreamError(request_id="a", seq=0, code="internal", message="x"), 0.2)
    assert "a" not in c.requests
    assert c.heartbeat(heartbeat(w, "inc-2"), 0.3) == []  # nothing left to re-dispatch


def test_a_worker_heard_again_after_its_loss_is_told_to_stop_each_re_dispatched_copy() -> None:
    c = core(max_batch=4)
    two_workers(c)
    w = running_on(c, "a")
    other = "w1" if w == "w0" else "w0"
    c.stream(chunk("a", 0, [11], w), 0.2)
    keep_alive(c, 2.5, other)
    c.worker_stats(stats(other, instance("i1" if other == "w1" else "i0")), 2.5)
    sends(c.tick(DEAD_AFTER + 0.3))  # w silent: re-dispatched to the other worker
    assert c.requests["a"].worker_id == other
    # w comes back, same process (a partition healed, or SIGCONT): its stale copy is told to stop, once
    effects = c.heartbeat(heartbeat(w), DEAD_AFTER + 1.0)
    (stop,) = [e for e in effects if isinstance(e, PublishAbort)]
    assert stop.abort.worker_id == w and stop.abort.reason == "superseded" and stop.abort.attempt == 1
    assert [e for e in c.stream(chunk("a", 1, [99], w), DEAD_AFTER + 1.1) if isinstance(e, PublishAbort)] == []
    assert c.requests["a"].next_seq == 1  # its chunk changed nothing
    assert c.abort(stop.abort, DEAD_AFTER + 1.2) == [] and "a" in c.requests  # hearing our own: the request goes on


def test_a_migrations_source_cannot_add_to_the_stream_past_its_hand_over() -> None:
    c = core(max_batch=4)
    two_workers(c)
    w = running_on(c, "a")
    other = "w1" if w == "w0" else "w0"
    c.stream(chunk("a", 0, [11], w), 0.2)
    moved = TokenChunk(request_id="a", seq=1, token_ids=[12], worker_id=other, handover=1)
    c.stream(moved, 0.3)  # the destination's first chunk: it owns seq 1.. now
    assert c.requests["a"].worker_id == other
    c.stream(chunk("a", 1, [98], w), 0.3)  # the source again (a hand-over it thought failed): ignored
    c.stream(chunk("a", 2, [97], w), 0.3)
    assert c.requests["a"].emitted == [11, 12] and c.requests["a"].worker_id == other

"""The dispatcher core's admission and routing decisions (pure: no NATS, time passed in)."""
from __future__ import annotations

from dispatcher.dispatch_builders import chunk, core, heartbeat, instance, sends, stats, submit, two_workers

from shared.events import AbortRequest, AssignAccepted, AssignRejected, SubmitAccepted, SubmitRejected, WorkerState
from services.dispatcher.tracked import Phase


def test_unknown_model_or_adapter_is_model_not_found() -> None:
    c = core()
    two_workers(c)
    for msg, why in ((submit("a", model="nope"), "'nope' does not exist"),
                     (submit("b", adapter="nope"), "adapter 'nope' does not exist"),
                     (submit("c", model="q", adapter="m-lora"), "belongs to 'm', not 'q'")):
        reply, effects = c.submit(msg, 1.0)
        assert isinstance(reply, SubmitRejected) and reply.reason == "model_not_found", reply
        assert why in reply.message and effects == []
    assert not c.requests


def test_prompt_plus_max_tokens_over_the_context_is_refused() -> None:
    c = core()
    two_workers(c)
    reply, _ = c.submit(submit("a", prompt=200, max_tokens=57), 1.0)  # 257 > 256
    assert isinstance(reply, SubmitRejected) and reply.reason == "context_length_exceeded"
    assert "256" in reply.message and "257" in reply.message
    reply, effects = c.submit(submit("b", prompt=200, max_tokens=56), 1.0)
    assert isinstance(reply, SubmitAccepted) and len(effects) == 1


def test_no_live_instance_is_no_capacity_with_retry_after() -> None:
    c = core()
    reply, _ = c.submit(submit("a"), 1.0)  # nothing heard from yet
    assert isinstance(reply, SubmitRejected) and reply.reason == "no_capacity" and reply.retry_after_s
    two_workers(c, now=1.0)
    reply, _ = c.submit(submit("b", model="q"), 1.0)  # a known model no instance serves
    assert isinstance(reply, SubmitRejected) and reply.reason == "no_capacity"
    c.worker_stats(stats("w0", instance("i0"), state=WorkerState.DRAINING), 1.0)
    c.worker_stats(stats("w1", instance("i1"), state=WorkerState.DRAINING), 1.0)
    reply, _ = c.submit(submit("c"), 1.0)
    assert isinstance(reply, SubmitRejected) and reply.reason == "no_capacity"


def test_assigns_to_the_least_loaded_instance_and_counts_its_own_assignments() -> None:
    c = core(max_batch=8)
    c.heartbeat(heartbeat("w0"), 0.0)
    c.heartbeat(heartbeat("w1"), 0.0)
    c.worker_stats(stats("w0", instance("i0", used=10, running=1)), 0.0)
    c.worker_stats(stats("w1", instance("i1", used=2, running=1)), 0.0)
    reply, effects = c.submit(submit("a", prompt=140), 0.1)
    (send,) = sends(effects)
    assert (send.worker_id, send.assignment.instance_id) == ("w1", "i1")
    assert send.assignment.idempotency_key == "a:0" and send.assignment.attempt == 0
    assert send.assignment.resume_token_ids == [] and send.assignment.next_seq == 0
    assert isinstance(reply, SubmitAccepted) and (reply.worker_id, reply.instance_id) == ("w1", "i1")
    # i1 now holds 2*16 + 140 queued prompt tokens > i0's 10*16 = 160: the next one goes to i0, before any new stats
    (send,) = sends(c.submit(submit("b", prompt=8), 0.2)[1])
    assert send.assignment.instance_id == "i0"
    assert [(r.request_id, r.worker_id, r.attempt, r.owner) for r in c.records] == [
        ("a", "w1", 0, "dispatcher-test"), ("b", "w0", 0, "dispatcher-test")]


def test_full_instances_queue_requests_then_the_bound_rejects() -> None:
    c = core(max_batch=1, queue_bound=2)
    two_workers(c)
    assert len(sends(c.submit(submit("a"), 0.1)[1])) == 1
    assert len(sends(c.submit(submit("b"), 0.1)[1])) == 1  # the other instance
    reply, effects = c.submit(submit("c"), 0.1)
    assert isinstance(reply, SubmitAccepted) and reply.worker_id is None and reply.queue_position == 1
    assert effects == []
    reply, _ = c.submit(submit("d", priority=5), 0.1)
    assert isinstance(reply, SubmitAccepted) and reply.queue_position == 1  # higher priority goes first
    reply, _ = c.submit(submit("e"), 0.1)
    assert isinstance(reply, SubmitRejected) and reply.reason == "queue_full" and reply.retry_after_s
    assert "e" not in c.requests
    # "a" finishes: the head of the queue (d, priority 5) takes its place on the same instance
    a_worker = c.requests["a"].worker_id
    effects = c.stream(chunk("a", 0, [5, 6], a_worker, final=True), 0.2)
    (send,) = sends(effects)
    assert send.assignment.request_id == "d" and send.worker_id == a_worker
    assert "a" not in c.requests and c.queues.position("c") == 1


def test_stats_that_show_room_drain_the_queue() -> None:
    c = core(max_batch=1)
    c.heartbeat(heartbeat("w0"), 0.0)
    c.worker_stats(stats("w0", instance("i0", running=1)), 0.0)  # busy with another dispatcher's work
    reply, effects = c.submit(submit("a"), 0.1)
    assert isinstance(reply, SubmitAccepted) and reply.queue_position == 1 and effects == []
    (send,) = sends(c.worker_stats(stats("w0", instance("i0", running=0)), 0.3))
    assert send.assignment.request_id == "a" and c.requests["a"].phase is Phase.ASSIGNING


def test_abort_removes_a_queued_request_and_forgets_a_running_one() -> None:
    c = core(max_batch=1)
    c.heartbeat(heartbeat("w0"), 0.0)
    c.worker_stats(stats("w0", instance("i0")), 0.0)
    c.submit(submit("a"), 0.1)
    c.submit(submit("b"), 0.1)
    assert c.requests["b"].phase is Phase.QUEUED
    assert c.abort(AbortRequest(request_id="b", ts=0.0), 0.2) == []
    assert "b" not in c.requests and len(c.queues) == 0
    c.submit(submit("c"), 0.2)
    effects = c.abort(AbortRequest(request_id="a", ts=0.0), 0.3)  # frees the slot: c goes
    assert "a" not in c.requests and [s.assignment.request_id for s in sends(effects)] == ["c"]


def test_a_rejected_assignment_moves_to_another_instance_or_back_to_the_queue() -> None:
    c = core(max_batch=4)
    two_workers(c)
    _, effects = c.submit(submit("a"), 0.1)
    (first,) = sends(effects)
    no_room = AssignRejected(request_id="a", worker_id=first.worker_id, reason="no_capacity", message="full")
    (second,) = sends(c.assign_outcome("a", first.assignment.idempotency_key, no_room, 0.2))
    assert second.worker_id != first.worker_id and second.assignment.idempotency_key == "a:0-1"
    no_room2 = AssignRejected(request_id="a", worker_id=second.worker_id, reason="no_capacity", message="full")
    assert c.assign_outcome("a", "a:0-1", no_room2, 0.3) == []
    assert c.requests["a"].phase is Phase.QUEUED and c.queues.position("a") == 1
    (third,) = sends(c.tick(1.0))  # the rejections' cool-down passed: tried again
    assert third.assignment.idempotency_key == "a:0-2"
    accepted = AssignAccepted(request_id="a", worker_id=third.worker_id, instance_id=third.assignment.instance_id)
    assert c.assign_outcome("a", "a:0-2", accepted, 1.1) == []
    assert c.requests["a"].phase is Phase.RUNNING
    assert c.assign_outcome("a", "a:0", accepted, 1.2) == []  # a stale reply changes nothing


def test_a_repeated_submit_is_answered_again_without_a_second_assignment() -> None:
    c = core()
    two_workers(c)
    first, effects = c.submit(submit("a"), 0.1)
    again, more = c.submit(submit("a"), 0.2)
    assert len(effects) == 1 and more == [] and again == first


def test_draining_refuses_new_submits() -> None:
    c = core()
    two_workers(c)
    c.draining = True
    reply, _ = c.submit(submit("a"), 0.1)
    assert isinstance(reply, SubmitRejected) and reply.reason == "draining"


def test_adapter_requests_prefer_workers_holding_the_adapter() -> None:
    c = core(max_batch=8)
    c.heartbeat(heartbeat("w0"), 0.0)
    c.heartbeat(heartbeat("w1"), 0.0)
    c.worker_stats(stats("w0", instance("i0", used=30)), 0.0)
    c.worker_stats(stats("w1", instance("i1")), 0.0)  # less loaded, but without the adapter
    c.worker_stats(stats("w0", instance("i0", used=30), adapters=("m-lora",)), 0.0)
    (send,) = sends(c.submit(submit("a", adapter="m-lora"), 0.1)[1])
    assert send.assignment.instance_id == "i0" and send.assignment.adapter == "m-lora"


def test_a_queued_request_past_its_deadline_ends_with_queue_timeout() -> None:
    c = core(max_batch=1)
    c.heartbeat(heartbeat("w0"), 0.0)
    c.worker_stats(stats("w0", instance("i0", running=1)), 0.0)
    c.submit(submit("a", deadline=2.0), 0.1)
    assert c.tick(1.0) == []
    c.heartbeat(heartbeat("w0"), 1.5)
    (err,) = c.tick(2.0)
    assert err.error.code == "queue_timeout" and err.error.request_id == "a" and "a" not in c.requests


def test_stats_count_arrivals_admissions_and_completions() -> None:
    c = core(max_batch=1, queue_bound=1)
    two_workers(c)
    c.submit(submit("a", prompt=10), 0.1)
    c.submit(submit("b", prompt=10), 0.1)
    c.submit(submit("c", prompt=10), 0.1)
    c.submit(submit("d", prompt=10), 0.1)  # queue full
    c.stream(chunk("a", 0, [1, 2, 3], c.requests["a"].worker_id or "", final=True, prompt=10), 0.5)
    s = c.take_stats(1.0)
    (load,) = [m for m in s.models if m.adapter is None]
    assert (load.arrivals, load.admitted, load.rejected, load.completed) == (4, 3, 1, 1)
    assert (load.prompt_tokens, load.output_tokens, load.queued) == (40, 3, 0)  # c went where a was
    assert s.arrival_rate("m") == 4.0 and s.dispatcher_id == "dispatcher-test"


def test_a_request_behind_a_waiting_adapter_request_goes_where_there_is_room() -> None:
    c = core(max_batch=1)
    c.heartbeat(heartbeat("w0"), 0.0)
    c.heartbeat(heartbeat("w1"), 0.0)
    c.worker_stats(stats("w0", instance("i0", running=1), adapters=("m-lora",)), 0.0)  # the holder is full
    c.worker_stats(stats("w1", instance("i1")), 0.0)
    reply, effects = c.submit(submit("a", adapter="m-lora"), 0.1)
    assert isinstance(reply, SubmitAccepted) and reply.queue_position == 1 and effects == []
    reply, effects = c.submit(submit("b"), 0.1)
    (send,) = sends(effects)
    assert send.assignment.request_id == "b" and send.worker_id == "w1"
    assert isinstance(reply, SubmitAccepted) and reply.worker_id == "w1"
    assert c.queues.in_order("m") == ["a"]

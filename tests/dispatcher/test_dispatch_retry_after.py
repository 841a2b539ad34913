"""Retry-After of a refused submit comes from the queue's measured drain rate (pure: time passed in)."""
from __future__ import annotations

import msgspec

from dispatcher.dispatch_builders import chunk, core, heartbeat, instance, stats, submit, two_workers

from shared.events import SubmitAccepted, SubmitRejected
from services.dispatcher.drain_rate import RETRY_MAX_S, DrainRate


def refusal_after(period_s: float) -> float:
    """Two instances of one slot each, a queue of 4 kept full; a request finishes every `period_s`
    for two minutes: the Retry-After a refused client is then told."""
    c = core(max_batch=1, queue_bound=4)
    two_workers(c)
    n = 0

    def more(now: float) -> None:
        nonlocal n
        while not c.queues.full("m"):
            reply, _ = c.submit(submit(f"r{n}"), now)
            assert isinstance(reply, SubmitAccepted)
            n += 1

    now = 0.1
    more(now)
    first, _ = c.submit(submit("early"), now)  # nothing has left the queue yet: its head's wait so far
    assert isinstance(first, SubmitRejected) and first.reason == "queue_full" and first.retry_after_s == 1.0
    while now < 120.0:
        now += period_s
        for worker, iid in (("w0", "i0"), ("w1", "i1")):  # both alive, each running its one request
            c.heartbeat(heartbeat(worker), now)
            c.worker_stats(stats(worker, instance(iid, running=1)), now)
        running = next(r for r in c.requests.values() if r.worker_id is not None)
        c.stream(chunk(running.request_id, 0, [5], running.worker_id, final=True), now)
        more(now)
    reply, _ = c.submit(submit("late"), now)
    assert isinstance(reply, SubmitRejected) and reply.reason == "queue_full"
    assert reply.retry_after_s is not None
    return reply.retry_after_s


def test_a_slow_queue_says_so() -> None:
    assert 7.0 <= refusal_after(2.0) <= 9.0  # 4 queued, half a request a second leaves: ~8 s, not 1
    assert 40.0 <= refusal_after(15.0) <= 70.0  # 4 a minute: about a minute (not capped at 30 s)


def test_drain_rate_is_measured_over_its_window_and_bounded() -> None:
    d = DrainRate(window_s=60.0)
    assert d.rate("m", 0.0) is None and d.retry_after("m", 10, 0.0, head_wait_s=42.0) == 42.0
    d.queued("m", 0.0)
    for t in range(6, 61, 6):  # 10 in the last minute
        d.left("m", float(t))
    assert d.rate("m", 60.0) == 10 / 60
    assert d.retry_after("m", 5, 60.0) == 30.0
    assert d.retry_after("m", 1000, 60.0) == RETRY_MAX_S
    assert d.retry_after("m", 0, 60.0) == 1.0
    assert d.rate("m", 200.0) is None  # nothing left in the last minute: no rate, the head's wait decides


def cold_burst_refusal(max_tokens: int, tokens_per_s: float) -> float:
    """Two instances of one slot each that already report their decode rate (first stats interval),
    a queue of 4 filled at once: the Retry-After of the next request, before any departure."""
    c = core(max_batch=1, queue_bound=4)
    for worker, iid in (("w0", "i0"), ("w1", "i1")):
        c.heartbeat(heartbeat(worker), 0.0)
        c.worker_stats(stats(worker, msgspec.structs.replace(instance(iid, running=1), tokens_per_s=tokens_per_s)),
                       0.0)
    n = 0
    while not c.queues.full("m"):
        reply, _ = c.submit(submit(f"r{n}", max_tokens=max_tokens), 0.1)
        assert isinstance(reply, SubmitAccepted)
        n += 1
    reply, _ = c.submit(submit("burst", max_tokens=max_tokens), 0.3)
    assert isinstance(reply, SubmitRejected) and reply.reason == "queue_full" and reply.retry_after_s is not None
    return reply.retry_after_s


def test_a_cold_burst_is_told_the_wait_from_the_workers_decode_rate_in_the_first_second() -> None:
    # 4 queued (the 2 running took the first 2) x 200 tokens at 2 x 20 tokens/s: 20 s, not 1 s
    assert cold_burst_refusal(200, 20.0) == 20.0
    assert cold_burst_refusal(200, 80.0) == 5.0  # twice as fast twice: a quarter
    assert cold_burst_refusal(200, 0.0) == 1.0  # nothing generated yet: the head's (tiny) wait, floored


def test_finished_requests_teach_the_typical_length() -> None:
    d = DrainRate()
    assert d.expected_tokens("m", 200) == 200.0  # nothing finished yet: max_tokens
    for _ in range(60):
        d.finished("m", 10)
    assert abs(d.expected_tokens("m", 200) - 10.0) < 0.01
    assert d.expected_tokens("m", 4) == 4.0  # never more than the request may generate
    assert d.retry_after("m", 4, 1.0, tokens_ahead=4 * 10.0, tokens_per_s=20.0) == 2.0

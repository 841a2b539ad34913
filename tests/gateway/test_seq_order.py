"""The gateway's stream order and assignment fence (services/gateway/seq_order.py), pure: no I/O.

Order: duplicates dropped, early chunks held, a gap that never fills skipped. Fence: once a newer
assignment (a re-dispatch's StreamReassigned, or a migration's first chunk) owns the stream from a
seq, a superseded worker can never add a byte at or past it; one that got there first breaks the
stream (the caller ends it with an error), never mixes two workers' text."""
from __future__ import annotations

from services.gateway.seq_order import SeqOrder
from shared.events.common import Usage
from shared.events.stream import StreamError, StreamReassigned, TokenChunk

RID = "r-1"


def chunk(seq: int, text: str = "", attempt: int = 0, handover: int = 0, worker: str = "w0",
          final: bool = False) -> TokenChunk:
    return TokenChunk(request_id=RID, seq=seq, token_ids=[seq], text=text or f"<{seq}:{worker}>", worker_id=worker,
                      attempt=attempt, handover=handover, finish_reason="length" if final else None,
                      usage=Usage(prompt_tokens=1, completion_tokens=seq + 1) if final else None)


def texts(msgs: list) -> list[str]:
    return [m.text if isinstance(m, TokenChunk) else f"error:{m.code}" for m in msgs]


def test_order_drops_duplicates_and_releases_held_chunks_in_order() -> None:
    order = SeqOrder()
    assert order.push(chunk(0)) == [chunk(0)]
    assert order.push(chunk(0)) == [] and order.duplicates == 1
    assert order.push(chunk(2)) == [] and order.waiting
    assert order.push(chunk(3)) == []
    assert order.push(chunk(1)) == [chunk(1), chunk(2), chunk(3)] and not order.waiting
    assert order.push(chunk(2)) == [] and order.duplicates == 2


def test_order_skips_a_gap_that_never_fills() -> None:
    order = SeqOrder(max_held=2)
    order.push(chunk(0))
    assert order.push(chunk(3)) == [] and order.push(chunk(4)) == []
    assert order.push(chunk(5)) == [chunk(3), chunk(4), chunk(5)]  # more than max_held waiting: skip seq 1-2
    assert order.skipped == 2
    order.push(chunk(7))
    assert order.skip_gap() == [chunk(7)] and order.skipped == 3


def test_a_re_dispatched_stream_never_takes_a_byte_from_the_worker_given_up_on() -> None:
    order = SeqOrder()
    out = order.push(chunk(0, worker="w0")) + order.push(chunk(1, worker="w0"))
    out += order.push(StreamReassigned(request_id=RID, attempt=1, from_seq=3, worker_id="w0"))
    out += order.push(chunk(2, worker="w0"))  # in flight before the cut: the dispatcher had it, it is valid
    out += order.push(chunk(3, worker="w0"))  # the zombie, after the cut: dropped
    out += order.push(chunk(3, "<3:w1>", attempt=1, worker="w1"))
    out += order.push(chunk(4, worker="w0", final=True))  # the zombie's end: dropped too
    out += order.push(chunk(4, "<4:w1>", attempt=1, worker="w1", final=True))
    assert texts(out) == ["<0:w0>", "<1:w0>", "<2:w0>", "<3:w1>", "<4:w1>"]
    assert order.stale == 2 and order.broken is None


def test_a_stale_chunk_held_behind_a_gap_is_dropped_when_the_fence_arrives() -> None:
    order = SeqOrder()
    order.push(chunk(0))
    assert order.push(chunk(2, worker="w0")) == []  # held: seq 1 is late
    assert order.push(StreamReassigned(request_id=RID, attempt=1, from_seq=1)) == []
    assert order.push(chunk(1, "<1:w1>", attempt=1, worker="w1")) == [chunk(1, "<1:w1>", attempt=1, worker="w1")]
    assert order.push(chunk(2, "<2:w1>", attempt=1, worker="w1")) == [chunk(2, "<2:w1>", attempt=1, worker="w1")]
    assert order.stale == 1


def test_a_migration_hands_the_stream_over_at_the_destinations_first_seq() -> None:
    order = SeqOrder()
    out = order.push(chunk(0, worker="src"))
    out += order.push(chunk(2, "<2:dst>", handover=1, worker="dst"))  # the destination's first chunk: owns seq 2..
    out += order.push(chunk(1, worker="src"))  # the source's last chunk, still valid (before the hand-over)
    out += order.push(chunk(2, "<2:src>", worker="src"))  # the source must not go on: dropped
    out += order.push(chunk(3, "<3:dst>", handover=1, worker="dst", final=True))
    assert texts(out) == ["<0:src>", "<1:src>", "<2:dst>", "<3:dst>"]
    assert order.epoch == (0, 1) and order.stale == 1


def test_a_stale_worker_that_beat_the_fence_breaks_the_stream_instead_of_mixing_texts() -> None:
    order = SeqOrder()
    order.push(chunk(0, worker="w0"))
    assert order.push(chunk(1, worker="w0")) == [chunk(1, worker="w0")]  # delivered before any fence
    assert order.push(StreamReassigned(request_id=RID, attempt=1, from_seq=1)) == []
    assert order.broken is not None and "superseded" in order.broken
    assert order.push(chunk(1, "<1:w1>", attempt=1, worker="w1")) == []  # nothing more, ever
    order = SeqOrder()
    order.push(chunk(0, worker="src"))
    order.push(chunk(1, worker="src"))
    assert order.push(chunk(1, handover=1, worker="dst")) == [] and order.broken is not None


def test_an_old_fence_is_ignored_and_the_dispatchers_error_always_ends_the_stream() -> None:
    order = SeqOrder()
    order.push(StreamReassigned(request_id=RID, attempt=2, from_seq=0))
    order.push(chunk(0, attempt=2, worker="w2"))
    assert order.push(StreamReassigned(request_id=RID, attempt=1, from_seq=0)) == [] and order.broken is None
    assert order.push(chunk(1, attempt=1, worker="w1")) == [] and order.stale == 1  # older attempt, past the fence
    order.push(chunk(1, attempt=2, worker="w2"))
    order.push(chunk(2, attempt=2, worker="w2"))
    # the dispatcher had seen seq 0 only when it gave up: its error still ends the stream, after what we sent
    error = StreamError(request_id=RID, seq=1, code="redispatch_limit", message="limit")
    assert order.push(error) == [error]
    worker_error = StreamError(request_id=RID, seq=3, code="internal", message="x", worker_id="w1", attempt=1)
    assert order.push(worker_error) == []  # a stale worker's error is fenced like its chunks

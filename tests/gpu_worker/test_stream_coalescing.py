"""StreamEncoder (pure): how engine outputs become coalesced TokenChunks — first token at
once, one flush of every pending stream per interval, nothing lost or repeated at the end,
on an error or on a detach (migration), seqs consecutive."""
from __future__ import annotations

import msgspec

from services.gpu_worker.engine.outputs import RequestOutput
from services.gpu_worker.stream import Payload, StreamEncoder
from shared.events import StreamError, TokenChunk
from shared.subjects import request_out

decoder = msgspec.msgpack.Decoder(TokenChunk | StreamError)


def step(enc: StreamEncoder, now: float, *outs: RequestOutput) -> tuple[list[TokenChunk | StreamError], list[str]]:
    payloads: list[Payload] = []
    ended: list[str] = []
    enc.encode_outputs(list(outs), now, payloads, ended)
    for subject, data in payloads:
        msg = decoder.decode(data)
        assert subject == request_out(msg.request_id)
    return [decoder.decode(d) for _, d in payloads], ended


def tok(rid: str, token: int, *, finished: bool = False, reason: str | None = None, n: int = 0,
        logprob: float | None = None) -> RequestOutput:
    return RequestOutput(rid, [token], f"<{token}>", finished=finished, finish_reason=reason, prompt_tokens=5,
                         completion_tokens=n, logprobs=None if logprob is None else [logprob])


def test_first_token_alone_then_one_chunk_per_interval() -> None:
    enc = StreamEncoder("w", interval_s=0.010)
    enc.open("a", 0, False)
    sent: list[TokenChunk | StreamError] = []
    for i in range(10):  # 10 steps 2 ms apart; token i at t = 2i ms
        msgs, ended = step(enc, i * 0.002, tok("a", 100 + i, finished=i == 9, reason="length" if i == 9 else None,
                                                n=i + 1))
        sent += msgs
    chunks = [m for m in sent if isinstance(m, TokenChunk)]
    assert len(chunks) == len(sent)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert chunks[0].token_ids == [100]  # TTFT: never held back
    assert [t for c in chunks for t in c.token_ids] == list(range(100, 110))
    assert "".join(c.text for c in chunks) == "".join(f"<{t}>" for t in range(100, 110))
    assert len(chunks) <= 4 and any(len(c.token_ids) >= 3 for c in chunks)  # ~5 steps per 10 ms
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10 and all(c.finish_reason is None for c in chunks[:-1])
    assert all(c.worker_id == "w" for c in chunks)


def test_interval_zero_sends_every_step() -> None:
    enc = StreamEncoder("w", interval_s=0.0)
    enc.open("a", 0, False)
    counts = [len(step(enc, i * 0.001, tok("a", i))[0]) for i in range(5)]
    assert counts == [1, 1, 1, 1, 1]


def test_every_pending_stream_is_flushed_together() -> None:
    enc = StreamEncoder("w", interval_s=0.010)
    for rid in ("a", "b", "c"):
        enc.open(rid, 0, False)
    first, _ = step(enc, 0.0, tok("a", 1), tok("b", 1), tok("c", 1))
    assert len(first) == 3  # three first tokens
    quiet = [len(step(enc, t, tok("a", 2), tok("b", 2), tok("c", 2))[0]) for t in (0.001, 0.003, 0.005)]
    assert quiet == [0, 0, 0]  # held until the flush
    burst, _ = step(enc, 0.020, tok("a", 3), tok("b", 3))  # c was preempted: no output this step
    assert sorted(m.request_id for m in burst) == ["a", "b", "c"]  # c's held tokens go out too


def test_resumed_stream_continues_its_seq() -> None:
    enc = StreamEncoder("w", interval_s=0.050)
    enc.open("r", 7, False)
    msgs, _ = step(enc, 0.0, tok("r", 1))
    msgs += step(enc, 0.001, tok("r", 2))[0]
    msgs += step(enc, 0.002, tok("r", 3, finished=True, reason="stop", n=3))[0]
    assert [m.seq for m in msgs] == [7, 8]  # the held token rode with the final one
    assert [t for m in msgs if isinstance(m, TokenChunk) for t in m.token_ids] == [1, 2, 3]
    assert msgs[-1].final


def test_error_sends_pending_tokens_first() -> None:
    enc = StreamEncoder("w", interval_s=1.0)
    enc.open("e", 0, False)
    step(enc, 0.0, tok("e", 1))
    step(enc, 0.001, tok("e", 2))
    err = RequestOutput("e", [], "", finished=True, finish_reason="error", error="boom", prompt_tokens=5,
                        completion_tokens=2)
    msgs, ended = step(enc, 0.002, err)
    assert ended == ["e"]
    assert isinstance(msgs[0], TokenChunk) and msgs[0].token_ids == [2] and msgs[0].seq == 1
    assert isinstance(msgs[1], StreamError) and msgs[1].seq == 2 and msgs[1].message == "boom"


def test_detach_returns_pending_tokens_as_a_chunk_and_the_next_seq() -> None:
    enc = StreamEncoder("w", interval_s=1.0)
    enc.open("m", 3, True)
    step(enc, 0.0, tok("m", 1, logprob=-0.5))
    step(enc, 0.001, tok("m", 2, logprob=-0.25))
    step(enc, 0.002, tok("m", 3, logprob=-2.0))
    flushed, next_seq = enc.detach("m")  # type: ignore[misc]
    assert flushed is not None and next_seq == 5
    chunk = decoder.decode(flushed[1])
    assert isinstance(chunk, TokenChunk) and chunk.seq == 4 and chunk.token_ids == [2, 3]
    assert chunk.logprobs is not None and [lp.logprob for lp in chunk.logprobs] == [-0.25, -2.0]
    assert chunk.finish_reason is None
    assert step(enc, 5.0, tok("m", 4))[0] == []  # detached: its later outputs are not ours
    assert enc.detach("m") is None


def test_detach_with_nothing_pending_sends_nothing() -> None:
    enc = StreamEncoder("w", interval_s=1.0)
    enc.open("m", 0, False)
    step(enc, 0.0, tok("m", 1))
    assert enc.detach("m") == (None, 1)


def test_abort_carries_the_pending_tokens_in_the_final_chunk() -> None:
    enc = StreamEncoder("w", interval_s=1.0)
    enc.open("x", 0, False)
    step(enc, 0.0, tok("x", 1))
    step(enc, 0.001, tok("x", 2))
    abort = RequestOutput("x", [], "", finished=True, finish_reason="abort", prompt_tokens=5, completion_tokens=2)
    msgs, ended = step(enc, 0.002, abort)
    assert ended == ["x"] and len(msgs) == 1
    final = msgs[0]
    assert isinstance(final, TokenChunk) and final.token_ids == [2] and final.finish_reason == "abort"
    assert final.seq == 1 and enc.tokens_emitted == 2


def test_encode_outputs_counts_the_first_tokens_it_sends() -> None:
    enc = StreamEncoder("w", interval_s=0.0)
    enc.open("a", 0, False)
    enc.open("b", 0, False)
    payloads: list[Payload] = []
    assert enc.encode_outputs([tok("a", 1)], 0.0, payloads, []) == 1
    assert enc.encode_outputs([tok("a", 2), tok("b", 1)], 0.001, payloads, []) == 1
    assert enc.encode_outputs([tok("a", 3), tok("b", 2)], 0.002, payloads, []) == 0

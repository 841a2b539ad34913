"""The prefix-sharing traces (loadgen/traces/prefix.py): their documented shapes, seeded, through the trace
file and into request bodies whose token ids share exactly the prefix the segments say."""
from __future__ import annotations

import json

from loadgen.runner.payloads import PayloadMaker
from loadgen.traces.generate import generate
from loadgen.traces.io import read_trace, write_trace
from loadgen.traces.schema import PrefixChatParams, PrefixSystemParams


def _ids(maker: PayloadMaker, i: int, rec) -> list[int]:
    return json.loads(maker.prepare(i, rec).payload)["prompt"]


def test_chat_turns_extend_the_conversation_so_far(tmp_path) -> None:
    params = PrefixChatParams(seed=3, duration_s=120.0, rate=0.2, model="m", turns=(2, 5))
    trace = generate(params)
    assert trace.records and trace.records == generate(params).records  # seeded
    by_session: dict[str, list] = {}
    for rec in trace.records:
        assert rec.prompt_tokens == sum(s.tokens for s in rec.segments)
        by_session.setdefault(rec.session, []).append(rec)
    assert any(len(turns) >= 2 for turns in by_session.values())
    maker = PayloadMaker(seed=3)
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.arrival_s - prev.arrival_s >= 1.0
            n = len(prev.segments)
            assert nxt.segments[:n] == prev.segments  # the history, then the reply's stand-in, then a new message
            assert [s.key.split("-")[-1][0] for s in nxt.segments[n:]] == ["a", "u"]
            assert _ids(maker, 0, nxt)[:prev.prompt_tokens] == _ids(maker, 0, prev)
    sessions = list(by_session)
    first = {s: _ids(maker, 0, by_session[s][0])[:64] for s in sessions[:2]}
    assert len(sessions) < 2 or first[sessions[0]] != first[sessions[1]]  # conversations share nothing
    back = read_trace(write_trace(tmp_path / "chat.jsonl", trace))
    assert back.records == trace.records and isinstance(back.header.params, PrefixChatParams)


def test_system_prompts_are_few_and_shared_token_for_token() -> None:
    trace = generate(PrefixSystemParams(seed=1, duration_s=60.0, rate=2.0, model="m", prompts=3, system_tokens=256))
    keys = {rec.segments[0].key for rec in trace.records}
    assert keys <= {"sys-0", "sys-1", "sys-2"} and len(keys) == 3
    maker = PayloadMaker(seed=1)
    ids = [(rec.segments[0].key, _ids(maker, i, rec)) for i, rec in enumerate(trace.records)]
    for key, prompt in ids:
        same = next(p for k, p in ids if k == key)
        other = next((p for k, p in ids if k != key), None)
        assert prompt[:256] == same[:256]
        assert other is None or other[:256] != prompt[:256]
        assert prompt[256:] != same[256:] or prompt is same  # each its own question

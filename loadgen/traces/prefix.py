"""Prefix-sharing traces (seeded): multi-turn chat and shared system prompts.

Each record's prompt is a list of named `segments`; a segment's token ids are a function of the
run's seed and its key alone (`segment_ids`), so requests whose segments start alike share that
prefix token for token, and a prefix cache can reuse its KV.

* `prefix-chat` (PrefixChatParams): conversations start as a Poisson process at `rate`; each has
  `turns` turns (uniform in the range); turn k arrives an exponential think time (mean `think_s`,
  at least 1 s) after turn k-1, and its prompt is the conversation so far —
  `sys, u0, a0, u1, a1, ..., uk`: the conversation's own system prompt, each earlier user
  message, and for each earlier reply a seeded stand-in of `output_tokens` tokens (the client's
  history holds the model's reply; a stand-in keeps the trace, and so every arm's prompts, fixed
  whatever the model answers). What turn k can reuse is turn k-1's prompt; a conversation's turns
  share nothing with other conversations.
* `prefix-system` (PrefixSystemParams): requests arrive as a Poisson process at `rate`; each picks
  one of `prompts` system prompts of `system_tokens` tokens uniformly and adds its own user message
  (uniform in `user_tokens`): `sys-j, q-i`. With N prompts and R requests, all but N can hit.
"""
from __future__ import annotations

import random

import numpy as np

from loadgen.traces.arrivals import arrivals, constant_rate
from loadgen.traces.schema import PrefixChatParams, PrefixSystemParams, Segment, Trace, TraceHeader, TraceRecord


def segment_ids(seed: int, key: str, n: int, id_range: tuple[int, int]) -> list[int]:
    """The token ids of segment `key` (n of them in [low, high)): a pure function of (seed, key)."""
    rng = random.Random(f"{seed}:{key}")
    low, high = id_range
    return [rng.randrange(low, high) for _ in range(n)]


def prompt_ids(seed: int, segments: tuple[Segment, ...], id_range: tuple[int, int]) -> list[int]:
    return [t for s in segments for t in segment_ids(seed, s.key, s.tokens, id_range)]


def _record(i: int, t: float, model: str, segments: list[Segment], output: int, session: str | None) -> TraceRecord:
    return TraceRecord(arrival_s=round(t, 6), model=model, prompt_tokens=sum(s.tokens for s in segments),
                       output_tokens=output, request_id=f"req-{i}", session=session, segments=tuple(segments))


def _trace(params: PrefixChatParams | PrefixSystemParams, rows: list[tuple[float, list[Segment], str | None]]) -> Trace:
    rows.sort(key=lambda r: r[0])
    out = params.output_tokens
    records = [_record(i, t, params.model, segs, out, session) for i, (t, segs, session) in enumerate(rows)]
    return Trace(header=TraceHeader(params=params, num_records=len(records), duration_s=params.duration_s),
                 records=records)


def generate_prefix_chat(p: PrefixChatParams) -> Trace:
    if p.turns[0] < 1 or p.turns[1] < p.turns[0]:
        raise ValueError(f"turns must be 1 <= lo <= hi, got {p.turns}")
    rng = np.random.default_rng([p.seed, 0xC4A7])
    starts = arrivals(rng, constant_rate(p.rate), p.duration_s)
    rows: list[tuple[float, list[Segment], str | None]] = []
    for c, start in enumerate(starts.tolist()):
        turns = int(rng.integers(p.turns[0], p.turns[1] + 1))
        history = [Segment(f"c{c}-sys", p.system_tokens)] if p.system_tokens else []
        t = start
        for k in range(turns):
            if t >= p.duration_s:
                break
            history.append(Segment(f"c{c}-u{k}", int(rng.integers(p.user_tokens[0], p.user_tokens[1] + 1))))
            rows.append((t, list(history), f"c{c}"))
            history.append(Segment(f"c{c}-a{k}", p.output_tokens))
            t += max(1.0, float(rng.exponential(p.think_s)))
    return _trace(p, rows)


def generate_prefix_system(p: PrefixSystemParams) -> Trace:
    if p.prompts < 1:
        raise ValueError(f"prompts must be >= 1, got {p.prompts}")
    rng = np.random.default_rng([p.seed, 0x5157])
    times = arrivals(rng, constant_rate(p.rate), p.duration_s).tolist()
    rows: list[tuple[float, list[Segment], str | None]] = []
    for i, t in enumerate(times):
        j = int(rng.integers(0, p.prompts))
        user = int(rng.integers(p.user_tokens[0], p.user_tokens[1] + 1))
        rows.append((t, [Segment(f"sys-{j}", p.system_tokens), Segment(f"q{i}", user)], f"sys-{j}"))
    return _trace(p, rows)


__all__ = ["generate_prefix_chat", "generate_prefix_system", "prompt_ids", "segment_ids"]

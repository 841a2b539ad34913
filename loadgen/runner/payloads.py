"""Request bodies for trace records: token-id prompts of exactly the trace's length.

The gateway takes a list of token ids as a completions prompt, so a prompt of N tokens is N
ids — no tokenizer needed on the client, and the served model sees exactly N prompt tokens.
Ids are drawn from [low, high) (clear of the special tokens at the start of the vocabulary)
by a seeded generator, so a run is reproducible; `ignore_eos` makes every output reach its
`max_tokens`. A record with `segments` (prefix-sharing traces) gets each segment's own seeded ids, so
records that start with the same segments share that prefix. Records longer than the model's
context are clamped (the tail cut), and the clamp is counted.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from loadgen.traces.prefix import prompt_ids
from loadgen.traces.schema import TraceRecord

DEFAULT_ID_RANGE = (16, 256)  # inside every vocabulary Tidal serves (the tiny test models have 512)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    index: int
    record: TraceRecord
    model: str  # what the request names: the adapter when it has one, else the base model
    prompt_tokens: int
    output_tokens: int
    payload: bytes
    clamped: bool


class PayloadMaker:
    def __init__(self, *, seed: int = 0, id_range: tuple[int, int] = DEFAULT_ID_RANGE,
                 context: dict[str, int] | None = None, temperature: float = 0.0) -> None:
        low, high = id_range
        if not 0 <= low < high:
            raise ValueError(f"token id range [{low}, {high}) is empty")
        rng = random.Random(seed)
        self.seed, self.id_range = seed, id_range
        # One long pool of ids; a prompt is a slice at a seeded offset, so building one is a slice
        # and a JSON dump, not N random draws while the run is timing.
        self.pool = [rng.randrange(low, high) for _ in range(1 << 16)]
        self.rng = rng
        self.context = context or {}
        self.temperature = temperature

    def prepare(self, index: int, rec: TraceRecord) -> PreparedRequest:
        prompt, output, clamped = rec.prompt_tokens, rec.output_tokens, False
        limit = self.context.get(rec.model)
        if limit is not None and prompt + output > limit:
            clamped = True
            output = max(1, min(output, limit // 2))
            prompt = max(1, min(prompt, limit - output))
        if rec.segments:  # named segments: equal keys are equal ids (a shared prefix, loadgen/traces/prefix.py)
            ids = prompt_ids(self.seed, rec.segments, self.id_range)[:prompt]
        else:
            start = self.rng.randrange(0, len(self.pool) - min(prompt, len(self.pool) - 1))
            ids = self.pool[start:start + prompt]
            while len(ids) < prompt:  # longer than the pool: wrap around
                ids += self.pool[: prompt - len(ids)]
        model = rec.adapter or rec.model
        body = {
            "model": model, "prompt": ids, "max_tokens": output, "temperature": self.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }
        payload = json.dumps(body, separators=(",", ":")).encode()
        return PreparedRequest(index, rec, model, prompt, output, payload, clamped)


__all__ = ["DEFAULT_ID_RANGE", "PayloadMaker", "PreparedRequest"]

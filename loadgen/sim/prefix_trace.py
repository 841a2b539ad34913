"""A seeded prefix-sharing trace for the prefix economy simulator (loadgen/sim/prefix_economy.py).

Two tenants share one worker's KV: `chat` requests open with one of a few shared system prompts
(Zipf popularity: a few hot, a tail of lukewarm ones) and `rag` requests open with a document drawn
from a large corpus (almost never the same twice: cached, it is a cold prefix). Each request adds a
unique suffix after its prefix and generates `output` tokens. Poisson arrivals. Pure: a list of rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixRequest:
    t: float  # arrival, seconds
    model: str  # "chat" or "rag": the instance that serves it
    prefix: str  # the shared part's id ("" for none)
    prefix_tokens: int
    suffix_tokens: int
    output: int


@dataclass(frozen=True)
class PrefixTraceParams:
    seed: int = 0
    duration_s: float = 600.0
    chat_rps: float = 4.0
    rag_rps: float = 2.0
    system_prompts: int = 24  # chat's shared system prompts
    zipf_s: float = 1.1  # their popularity: P(k) ~ 1 / k^s
    system_tokens: int = 1024
    documents: int = 5000  # rag's corpus (uniform: a repeat is rare)
    document_tokens: int = 2048
    suffix_tokens: int = 64
    output: int = 128


def prefix_trace(p: PrefixTraceParams) -> list[PrefixRequest]:
    rng = np.random.default_rng(p.seed)
    ranks = np.arange(1, p.system_prompts + 1, dtype=float)
    zipf = ranks ** -p.zipf_s
    zipf /= zipf.sum()
    out: list[PrefixRequest] = []
    for model, rps in (("chat", p.chat_rps), ("rag", p.rag_rps)):
        t = 0.0
        while rps > 0:
            t += float(rng.exponential(1.0 / rps))
            if t >= p.duration_s:
                break
            if model == "chat":
                k = int(rng.choice(p.system_prompts, p=zipf))
                out.append(PrefixRequest(t, model, f"sys{k}", p.system_tokens, p.suffix_tokens, p.output))
            else:
                d = int(rng.integers(p.documents))
                out.append(PrefixRequest(t, model, f"doc{d}", p.document_tokens, p.suffix_tokens, p.output))
    out.sort(key=lambda r: (r.t, r.model))
    return out


__all__ = ["PrefixRequest", "PrefixTraceParams", "prefix_trace"]

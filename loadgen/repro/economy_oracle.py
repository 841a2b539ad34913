"""Hindsight oracles for the economy repro: how far any choice among the memory-bounded arms could go on one
trace, so the headline's goal can be read against what is reachable at all (issue 32).

Every arm replays the same requests in the same order, so the arms' per-request TTFTs line up. Three oracles,
each a P99 TTFT over the whole trace:

- `phase-switch`: in each phase of the phased trace, the single mechanism with the lowest P99 there (what a
  perfect switch between the four mechanisms, told each phase's best in advance, would give);
- `request-best-single`: each request's lowest TTFT among the four single mechanisms;
- `request-best-bounded`: each request's lowest TTFT among every memory-bounded arm (the singles, the fixed
  order and the arbiter).

The per-request ones are not reachable by any one run (a request's best outcome in one arm came with other
requests' outcomes in that arm): they are generous references. A goal above them needs, for the trace's slowest
requests, a TTFT lower than every one of these arms gave them — a different decision than any arm made, or
memory no source on the market supplies (`unbounded` shows what memory itself could give).
"""
from __future__ import annotations

import math

import numpy as np

from loadgen.sim.economy_result import SINGLE_ARMS

BOUNDED_ARMS = (*SINGLE_ARMS, "fixed-order", "arbiter")


def _p99(ttft: np.ndarray) -> float:
    ok = ttft[~np.isnan(ttft)]
    return float(np.percentile(ok, 99)) if ok.size else math.nan


def _request_best(ttfts: dict[str, np.ndarray], arms: tuple[str, ...]) -> float:
    got = [ttfts[a] for a in arms if a in ttfts]
    if not got:
        return math.nan
    stack = np.stack([np.where(np.isnan(t), np.inf, t) for t in got])
    best = stack.min(axis=0)  # a request failed in every arm stays failed (NaN), as p99_ttft leaves it out
    return _p99(np.where(np.isinf(best), np.nan, best))


def hindsight_oracles(ttfts: dict[str, np.ndarray], phase: np.ndarray | None) -> dict[str, float]:
    """P99 TTFT of each oracle from the arms' per-request TTFTs (NaN: no token) on one trace; `phase`: each
    request's phase index (None: not a phased trace, no phase switch). Arms not run are left out."""
    sizes = {t.size for t in ttfts.values()}
    if len(sizes) > 1:
        raise ValueError(f"hindsight oracles: the arms ran different traces (request counts {sorted(sizes)})")
    out = {"request-best-single": _request_best(ttfts, SINGLE_ARMS),
           "request-best-bounded": _request_best(ttfts, BOUNDED_ARMS)}
    singles = [a for a in SINGLE_ARMS if a in ttfts]
    if phase is not None and singles:
        if phase.size != next(iter(sizes)):
            raise ValueError(f"hindsight oracles: {phase.size} phase labels for {next(iter(sizes))} requests")
        merged = np.full(phase.size, np.nan)
        for k in np.unique(phase):
            sel = phase == k
            best = min(singles, key=lambda a: (np.nan_to_num(_p99(ttfts[a][sel]), nan=math.inf),
                                               SINGLE_ARMS.index(a)))
            merged[sel] = ttfts[best][sel]
        out["phase-switch"] = _p99(merged)
    return out


__all__ = ["BOUNDED_ARMS", "hindsight_oracles"]

"""Pure parts of `tidal bench lora`: the trace, the load pacing derived from the paper, the statistics.

No I/O, no clock: the bench (lora.py) measures and passes numbers in.

Load pacing (`paced_bandwidth`): on a CPU worker the adapter "device copy" is a memory copy, so the
worker paces it (`lora_load_bandwidth`). For the comparison to mean what the paper's does, a load
must cost, relative to a prefill on this CPU, what it costs relative to a prefill on the paper's GPU
(Llama-2-7B, one A10, LightLLM). Published numbers:

* a rank-64 adapter on W_q, W_k, W_v of Llama-2-7B is "approximately 100 MiB" (CaraServe §2.3);
  sizes scale with the rank;
* its load: Fig. 3-Left gives the cold-start share of the whole request time as 10% / 16% / 20% at
  3 / 6 / 9 RPS (rank 64, §2.3). Under Fig. 2's batching each arrival's load stalls every running
  request, so a request of duration D pays X (1 + RPS * D): share = X / D + X * RPS. The least-squares
  line through the three points has slope 0.01667 per RPS, so X = 16.7 ms (and D = 0.31 s); that is
  ~6 GB/s effective, within the "a few to tens of milliseconds" the text gives for Fig. 3-Right;
* a prefill of a typical (short, Alpaca) prompt on that server: ~32 ms. Fig. 5's decode iteration is
  31.8 ms (BGMV intercept, the weights read, loadgen/sim/profiles/lora/caraserve-a10-llama2-7b.toml);
  a short prompt's prefill reads the same weights, and a 128-token one needs 2 x 6.74e9 x 128 FLOP =
  27.6 ms at 50% of the A10's 125 TFLOPS — both ~32 ms.

So a rank-64 load costs PAPER_LOAD_OVER_PREFILL = 16.7 / 32 = 0.52 prefills of a typical prompt; the
bench measures that prefill here and paces loads so the largest adapter takes the same share.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

PAPER_RANK64_LOAD_S = 0.0167  # CaraServe Fig. 3-Left fit, see above
PAPER_TYPICAL_PREFILL_S = 0.032  # Llama-2-7B on an A10: Fig. 5's weights-bound iteration
PAPER_LOAD_OVER_PREFILL = PAPER_RANK64_LOAD_S / PAPER_TYPICAL_PREFILL_S


def paced_bandwidth(rank64_bytes: int, prefill_s: float, ratio: float = PAPER_LOAD_OVER_PREFILL) -> float:
    """Bytes/s at which a rank-64 adapter of `rank64_bytes` loads in `ratio` x `prefill_s`."""
    if rank64_bytes <= 0 or prefill_s <= 0 or ratio <= 0:
        raise ValueError(f"need rank64_bytes, prefill_s, ratio > 0, got {rank64_bytes}, {prefill_s}, {ratio}")
    return rank64_bytes / (ratio * prefill_s)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at_s: float  # arrival, from the start of the round
    prompt: list[int]
    slot: int  # which adapter of the round (fresh names per round and mode, same files)
    cold: bool  # the round's first request for this adapter: not resident unless cached


def make_trace(n: int, rps: float, prompt: tuple[int, int], vocab: int, reuse: float, seed: int) -> list[TraceRequest]:
    """Poisson arrivals; each request asks for a new adapter, or with probability `reuse` one an
    earlier request of the round used (uniformly). Request 0 is always new."""
    if not 0.0 <= reuse < 1.0:
        raise ValueError(f"--reuse must be in [0, 1), got {reuse}")
    rng = random.Random(seed)
    t, out, slots = 0.0, [], 0
    for i in range(n):
        t += rng.expovariate(rps)
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))]
        if i > 0 and rng.random() < reuse:
            out.append(TraceRequest(t, ids, rng.randrange(slots), False))
        else:
            out.append(TraceRequest(t, ids, slots, True))
            slots += 1
    return out


def adapter_slots(trace: list[TraceRequest]) -> int:
    return 1 + max(r.slot for r in trace)


def paired_overhead(rows: list[dict], base: list[dict], key: str, which: str, stat: str = "median") -> float | None:
    """stat(key over the selected requests) / stat(the same requests under cached) - 1; stat is
    "median" (robust to a shared machine's bursts) or "mean" (the paper's).
    which: "all" | "cold" | "warm" (as the trace marks them); None if none selected."""
    picked = [i for i, r in enumerate(rows) if which == "all" or r["cold"] == (which == "cold")]
    if not picked:
        return None
    agg = statistics.median if stat == "median" else statistics.fmean
    return agg([rows[i][key] for i in picked]) / agg([base[i][key] for i in picked]) - 1


def round_overheads(rounds: list[dict[str, list[dict]]], modes: list[str],
                    stat: str = "median") -> dict[str, dict[str, list[float]]]:
    """Per mode, per "<metric>_<which>" the overhead against cached in each round."""
    out: dict[str, dict[str, list[float]]] = {}
    for mode in modes:
        if mode == "cached":
            continue
        per: dict[str, list[float]] = {}
        for rec in rounds:
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                for which in ("all", "cold", "warm"):
                    o = paired_overhead(rec[mode], rec["cached"], key, which, stat)
                    if o is not None:
                        per.setdefault(f"{key}_{which}", []).append(o)
        out[mode] = per
    return out


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def mode_stats(rounds: list[dict[str, list[dict]]], mode: str, key: str, which: str) -> list[float]:
    """Per round, the median of `key` over the mode's selected requests (the marks are the trace's,
    so under cached "cold" names the requests that are cold in the other modes)."""
    out = []
    for rec in rounds:
        picked = [r[key] for r in rec[mode] if which == "all" or r["cold"] == (which == "cold")]
        if picked:
            out.append(statistics.median(picked))
    return out


def summary_line(over: dict[str, dict[str, list[float]]]) -> str:
    """The cold requests' TTFT overhead against cached, median over rounds (the paper's synthetic
    trace is all cold requests, so its TTFT overhead is this one)."""
    def pct(mode: str) -> str:
        vals = over.get(mode, {}).get("ttft_s_cold")
        return f"{statistics.median(vals) * 100:.0f}%" if vals else "n/a"

    return (f"bench lora: ttft_overhead_cpu_assist={pct('cpu_assist')} ttft_overhead_ondemand={pct('ondemand')} "
            f"ttft_overhead_slora={pct('slora')}")

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

CPU LoRA pacing (`cpu_pace`): at hidden 512 a LoRA is ~5% of the base FLOPs and a helper core is as
fast as the engine's, so unpaced CPU assist costs far less of a prefill here than on the paper's
server. Its share there, for the bench's typical prompt (128 tokens, rank 64 on q/k/v of
Llama-2-7B, 32 layers): 2 x 2 x 4096 x 3 x 32 x 64 x 128 = 12.9 GFLOP on the 8 cores of Fig. 18-Right,
plus §4.2's invocation (< 1 ms; 1 ms taken). The paper gives no CPU rate or dtype; one core of this
workplace's EPYC measured 28.9 GFLOP/s in fp32 and 199 GFLOP/s in bf16 (loadgen/repro/caraserve_cold.py):
56.7 ms (fp32) or 9.1 ms (bf16) against the 32 ms prefill: CPU_RATIOS = 1.77 and 0.28. The bench runs
its CPU arms at each stated ratio (`--cpu-ratio`, a sweep), pacing each helper call to
rows x rank x pace seconds so that the typical prompt's helper calls add up to ratio x the prefill here.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

PAPER_RANK64_LOAD_S = 0.0167  # CaraServe Fig. 3-Left fit, see above
PAPER_TYPICAL_PREFILL_S = 0.032  # Llama-2-7B on an A10: Fig. 5's weights-bound iteration
PAPER_LOAD_OVER_PREFILL = PAPER_RANK64_LOAD_S / PAPER_TYPICAL_PREFILL_S
_TYPICAL_CPU_FLOP = 2 * 2 * 4096 * 3 * 32 * 64 * 128  # rank-64 q/k/v LoRA of a 128-token Llama-2-7B prompt
CPU_RATIOS = tuple(round((_TYPICAL_CPU_FLOP / (8 * rate) + 1e-3) / PAPER_TYPICAL_PREFILL_S, 2)
                   for rate in (199e9, 28.9e9))  # (bf16, fp32) on 8 cores: (0.28, 1.77)


def cpu_pace(ratio: float, prefill_s: float, tokens: int, rank: int, calls: int, helpers: int) -> float:
    """Seconds per row x rank of a helper call such that a prompt of `tokens` at `rank` (`calls` helper
    calls per step: layers x targeted groups; its rows split over `helpers`) spends `ratio` x `prefill_s`
    on the helpers."""
    if min(ratio, prefill_s) <= 0 or min(tokens, rank, calls, helpers) < 1:
        raise ValueError(f"cpu_pace: need ratio, prefill_s > 0 and tokens, rank, calls, helpers >= 1, got "
                         f"{ratio}, {prefill_s}, {tokens}, {rank}, {calls}, {helpers}")
    return ratio * prefill_s * helpers / (calls * tokens * rank)


def paced_bandwidth(rank64_bytes: int, prefill_s: float, ratio: float = PAPER_LOAD_OVER_PREFILL) -> float:
    """Bytes/s at which a rank-64 adapter of `rank64_bytes` loads in `ratio` x `prefill_s`."""
    if rank64_bytes <= 0 or prefill_s <= 0 or ratio <= 0:
        raise ValueError(f"need rank64_bytes, prefill_s, ratio > 0, got {rank64_bytes}, {prefill_s}, {ratio}")
    return rank64_bytes / (ratio * prefill_s)


PAPER_RPS = 9.0  # CaraServe §7.2: the synthetic workload's aggregate rate on one A10
# MAF-like arrivals are bursty: gamma gaps with this coefficient of variation. OUR ASSUMPTION: the MAF
# trace is not in the library; the Azure LLM inference trace 2023 that is (../shared/data/azure-llm-2023)
# measures CV 1.09 (conversation) and 13.2 (code) over an hour, so 2.0 sits between a Poisson stream and
# the burstiest production stream we can measure.
MAF_CV = 2.0


@dataclass(frozen=True, slots=True)
class Workload:
    """One of the paper's single-server workloads (§7.2), its rate in the paper's units (RPS on the A10)."""

    name: str
    ranks: tuple[int, ...]
    paper_rps: float
    cold_fraction: float  # share of requests for an adapter not used before in the round
    adapters: int = 0  # MAF-like: adapters on the server (Zipf popularity); 0: a new one per cold request
    cv: float = 1.0  # arrival gaps' coefficient of variation (1: Poisson)
    about: str = ""


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("synthetic-r64", (64,), PAPER_RPS, 1.0, about="Fig. 10: Poisson 9 RPS, rank 64, every request cold"),
    Workload("synthetic-r32", (32,), PAPER_RPS, 1.0, about="Fig. 13-Top: Poisson 9 RPS, rank 32, every request cold"),
    Workload("synthetic-r64-6rps", (64,), 6.0, 1.0, about="Fig. 13-Bottom: Poisson 6 RPS, rank 64, every request cold"),
    Workload("maf-128", (64,), 1.5, 0.0, adapters=128, cv=MAF_CV, about="Fig. 14: MAF-like, 128 adapters, 1.5 RPS"),
    Workload("maf-256", (64,), 3.6, 0.0, adapters=256, cv=MAF_CV, about="Fig. 14: MAF-like, 256 adapters, 3.6 RPS"),
    Workload("maf-512", (64,), 7.7, 0.0, adapters=512, cv=MAF_CV, about="Fig. 14: MAF-like, 512 adapters, 7.7 RPS"),
)}


def scaled_rate(paper_rps: float, prefill_s: float, paper_prefill_s: float = PAPER_TYPICAL_PREFILL_S) -> float:
    """The paper's rate scaled to this machine's capacity: as many arrivals per typical prefill as on the A10."""
    if prefill_s <= 0:
        raise ValueError(f"prefill_s must be > 0, got {prefill_s}")
    return paper_rps * paper_prefill_s / prefill_s


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at_s: float  # arrival, from the start of the round
    prompt: list[int]
    slot: int  # which adapter of the round (fresh names per round and mode, same files)
    cold: bool  # the round's first request for this adapter: not resident unless cached
    rank: int = 64


def make_trace(n: int, rps: float, prompt: tuple[int, int], vocab: int, reuse: float, seed: int, *,
               ranks: tuple[int, ...] = (64,), adapters: int = 0, cv: float = 1.0) -> list[TraceRequest]:
    """Arrivals at `rps` (gamma gaps of coefficient of variation `cv`; 1 = Poisson). Without `adapters`,
    each request asks for a new adapter (cold), or with probability `reuse` one an earlier request of
    the round used (warm); request 0 is always new. With `adapters` (MAF-like) each request draws one
    of them by Zipf popularity (s = 1), cold on its first use in the round. Ranks: drawn per adapter."""
    if not 0.0 <= reuse <= 1.0:
        raise ValueError(f"reuse must be in [0, 1], got {reuse}")
    if rps <= 0 or cv <= 0 or not ranks or min(ranks) < 1:
        raise ValueError(f"need rps > 0, cv > 0 and ranks >= 1, got {rps}, {cv}, {ranks}")
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    t, out, slots = 0.0, [], 0
    rank_of: dict[int, int] = {}
    weights = [1.0 / (k + 1) for k in range(adapters)]
    for i in range(n):
        t += rng.expovariate(rps) if cv == 1.0 else rng.gammavariate(shape, cv * cv / rps)
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))]
        if adapters:
            slot = rng.choices(range(adapters), weights)[0]
            cold = slot not in rank_of
        elif i > 0 and rng.random() < reuse:
            slot, cold = rng.randrange(slots), False
        else:
            slot, cold = slots, True
            slots += 1
        if slot not in rank_of:
            rank_of[slot] = rng.choice(ranks)
        out.append(TraceRequest(t, ids, slot, cold, rank_of[slot]))
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


def round_overheads(rounds: list[dict[str, list[dict]]], modes: list[str], stat: str = "median",
                    baselines: dict[str, str] | None = None) -> dict[str, dict[str, list[float]]]:
    """Per mode, per "<metric>_<which>" the overhead against its Cached in each round (`baselines`:
    mode -> the Cached arm on its kernel; default "cached")."""
    out: dict[str, dict[str, list[float]]] = {}
    for mode in modes:
        if mode.startswith("cached"):
            continue
        base = (baselines or {}).get(mode, "cached")
        per: dict[str, list[float]] = {}
        for rec in rounds:
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                for which in ("all", "cold", "warm"):
                    o = paired_overhead(rec[mode], rec[base], key, which, stat)
                    if o is not None:
                        per.setdefault(f"{key}_{which}", []).append(o)
        out[mode] = per
    return out


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def mode_stats(rounds: list[dict[str, list[dict]]], mode: str, key: str, which: str,
               stat: str = "median") -> list[float]:
    """Per round, the median (or mean) of `key` over the mode's selected requests (the marks are the
    trace's, so under cached "cold" names the requests that are cold in the other modes)."""
    agg = statistics.median if stat == "median" else statistics.fmean
    out = []
    for rec in rounds:
        picked = [r[key] for r in rec[mode] if which == "all" or r["cold"] == (which == "cold")]
        if picked:
            out.append(agg(picked))
    return out


def summary_line(over: dict[str, dict[str, list[float]]], which: str = "cold", choices: dict[str, int] | None = None,
                 ratio: str = "") -> str:
    """The selected requests' TTFT overhead against Cached, median over rounds [min..max] (the paper's
    synthetic trace is all cold requests, so its TTFT overhead is the cold requests' one); the CPU arms
    at the first ratio of the sweep (`ratio`: its "@R" suffix); the decision rule's choices."""
    def pct(mode: str) -> str:
        vals = over.get(mode, {}).get(f"ttft_s_{which}")
        if not vals:
            return "n/a"
        med, lo, hi = spread(vals)
        return f"{med * 100:.0f}%[{lo * 100:.0f}..{hi * 100:.0f}]"

    n = len(next(iter(over.values()), {}).get(f"ttft_s_{which}", []))
    arms = [("cpu_assist", "cpu_assist" + ratio), ("async", "async"), ("auto", "auto" + ratio),
            ("ondemand", "ondemand"), ("slora", "slora")]
    line = "bench lora: " + " ".join(f"ttft_overhead_{key}={pct(mode)}" for key, mode in arms)
    line += f" rounds={n}" + (f" cpu_ratio={ratio[1:]}" if ratio else "")
    if choices is not None:
        line += " auto_choices=" + ",".join(f"{k}:{v}" for k, v in choices.items())
    return line

"""BurstGPT-like load: a base rate with sudden bursts (KunServe §5.1, BurstGPT trace).

The rate is `rate` outside bursts and `magnitude x rate` inside one; a burst rises
linearly over its first `ramp_s` seconds and falls over its last `ramp_s` seconds, so a
14x burst arrives "within seconds". Lengths come from a KunServe Table 2 dataset.
"""
from __future__ import annotations

import numpy as np

from loadgen.traces.arrivals import arrivals
from loadgen.traces.build import make_trace
from loadgen.traces.lengths import sample_lengths
from loadgen.traces.schema import Burst, BurstGPTParams, Trace


def burst_envelope(t: np.ndarray, burst: Burst) -> np.ndarray:
    """0 outside the burst, 1 on its plateau, linear on its ramps."""
    ramp = max(min(burst.ramp_s, burst.duration_s / 2), 1e-9)
    start, end = burst.start_s, burst.start_s + burst.duration_s
    rise = np.clip((t - start) / ramp, 0.0, 1.0)
    fall = np.clip((end - t) / ramp, 0.0, 1.0)
    return np.minimum(rise, fall)


def burst_rate(params: BurstGPTParams):
    def rate(t: np.ndarray) -> np.ndarray:
        r = np.full_like(t, params.rate, dtype=np.float64)
        for b in params.bursts:
            r += params.rate * (b.magnitude - 1.0) * burst_envelope(t, b)
        return r
    return rate


def place_bursts(seed: int, duration_s: float, count: int, burst_duration_s: float, magnitude: float,
                 ramp_s: float = 2.0) -> list[Burst]:
    """`count` bursts at seeded random times, one in each of `count` equal slots (never overlapping)."""
    if count <= 0:
        return []
    slot = duration_s / count
    if burst_duration_s >= slot:
        raise ValueError(f"{count} bursts of {burst_duration_s}s do not fit in {duration_s}s without overlap")
    rng = np.random.default_rng([seed, 0xB0757])
    starts = [i * slot + rng.uniform(0, slot - burst_duration_s) for i in range(count)]
    return [Burst(start_s=round(float(s), 3), duration_s=burst_duration_s, magnitude=magnitude, ramp_s=ramp_s)
            for s in starts]


def generate_burstgpt(params: BurstGPTParams) -> Trace:
    for b in params.bursts:
        if b.magnitude < 0 or b.duration_s <= 0:
            raise ValueError(f"bad burst {b}: magnitude must be >= 0 and duration > 0")
    rng = np.random.default_rng(params.seed)
    dt = min([0.05] + [max(b.ramp_s, 0.01) / 10 for b in params.bursts])
    times = arrivals(rng, burst_rate(params), params.duration_s, dt=dt, cv=params.cv)
    prompts, outputs = sample_lengths(params.dataset, rng, len(times))
    return make_trace(params, params.duration_s, times, [params.model], np.zeros(len(times), np.int64),
                      prompts, outputs)


# --- 1-second bins, as KunServe's harness replays BurstGPT (SJTU-IPADS/kunserve, evaluation/) ---
# evaluation/trace/burstgpt.py keeps `int(Timestamp / 10)` of a CSV segment (the /10 time scaling:
# 1-second bins); evaluation/trace.py replays the gaps between those integer timestamps, so every
# request of a bin arrives at its start; evaluation/bench.py upscales by a factor f as TraceUpscaler
# does: each trace row is tried ceil(f) times and each try is kept with probability f / ceil(f).


def bin_counts(times_s: np.ndarray | list[float], duration_s: float | None = None) -> np.ndarray:
    """Requests per 1-second bin (`int(t)`, as the harness truncates its timestamps)."""
    t = np.floor(np.asarray(times_s, dtype=np.float64)).astype(np.int64)
    if t.size and t.min() < 0:
        raise ValueError("arrival times must be >= 0")
    n = int(np.ceil(duration_s)) if duration_s is not None else (int(t.max()) + 1 if t.size else 0)
    return np.bincount(t[t < n], minlength=n) if n else np.zeros(0, np.int64)


def upscale_bins(counts: np.ndarray, factor: float, rng: np.random.Generator) -> np.ndarray:
    """The harness's ceil(f)-Bernoulli upscaling: each of a bin's rows is tried ceil(f) times, each
    try kept with probability f / ceil(f). The mean is f x counts; f = 1 keeps every row."""
    if factor <= 0:
        raise ValueError(f"the upscaling factor must be > 0, got {factor}")
    reps = int(np.ceil(factor))
    return rng.binomial(np.asarray(counts, dtype=np.int64) * reps, factor / reps)


def bin_arrivals(counts: np.ndarray) -> np.ndarray:
    """Arrival times of binned counts: every request of bin i arrives at i seconds."""
    return np.repeat(np.arange(len(counts), dtype=np.float64), np.asarray(counts, dtype=np.int64))


def spike_bins(rng: np.random.Generator, duration_s: float, base_per_s: float, bursts: list[Burst]) -> np.ndarray:
    """Poisson counts per 1-second bin of a base rate with bursts (`burst_envelope` at bin starts)."""
    t = np.arange(int(np.ceil(duration_s)), dtype=np.float64)
    rate = np.full_like(t, base_per_s)
    for b in bursts:
        rate += base_per_s * (b.magnitude - 1.0) * burst_envelope(t + 0.5, b)
    return rng.poisson(rate)

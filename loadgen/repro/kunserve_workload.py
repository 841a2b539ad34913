"""The workload of `tidal repro kunserve`, in the paper's regime (KunServe §2.2-§2.3, §5.1).

Two streams, both in 1-second bins and both upscaled by the harness's ceil(f)-Bernoulli rule
(loadgen/traces/burstgpt.py `upscale_bins`; f is the point's `scale`, the harness's
`dataset_scale_factor`):

- a long-lived base: requests whose outputs run for minutes. §2.2: a BurstGPT request stays 12 s on
  average with a 149 s spread, "up to 386s"; §2.3: the average memory load is 49.8%. Requests with
  the dataset's mean stay cannot hold KV half full without a compute queue (the prefill they need
  exceeds the cluster's, measured in docs/benchmarks.md), so the memory the paper's cluster holds
  before a spike is held by the stay-time tail: here, outputs uniform in `long_output` tokens
  (our stand-in for that tail), arriving from t = 0 so KV is filled before the window opens.
- short requests with the dataset's lengths (KunServe Table 2) at a base rate, with several spikes
  of seconds at `burst_magnitude` x the base (§2.2: "increases by 14x ... with no clear pattern")
  placed at seeded times in the window, or the 1-second bins of a real BurstGPT segment
  (`tidal trace burstgpt --csv FILE --kunserve-segment`: the harness's rows, timestamps / 10).

Statistics are taken over the window [warmup_s, duration_s): requests arriving in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.traces.build import make_trace
from loadgen.traces.burstgpt import bin_arrivals, bin_counts, spike_bins, upscale_bins
from loadgen.traces.lengths import sample_lengths
from loadgen.traces.schema import Burst, BurstGPTParams, Trace

MODEL = "qwen2.5-14b"
MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class Workload:
    warmup_s: float = 150.0  # the long-lived base fills KV; no spikes, not measured
    duration_s: float = 330.0  # arrivals end here; the window is [warmup_s, duration_s)
    short_per_s: float = 4.0  # short requests per second at scale 1 (the whole cluster)
    long_per_s: float = 3.0  # long-lived requests per second at scale 1
    long_output: tuple[int, int] = (1024, 4096)  # ours: the stay-time tail (§2.2: up to 386 s)
    spikes: int = 4
    spike_s: tuple[float, float] = (3.0, 10.0)  # "spikes of seconds" (Fig. 1a), drawn per spike
    burst_magnitude: float = 14.0  # §2.2
    bins: tuple[int, ...] | None = None  # a real segment's short-request bins (replaces the spikes)

    def spikes_at(self, seed: int) -> list[Burst]:
        """The spikes, one in each equal slot of the window (never overlapping), seeded."""
        if self.bins is not None or self.spikes <= 0:
            return []
        rng = np.random.default_rng([seed, 0x5B1CE])
        slot = (self.duration_s - self.warmup_s) / self.spikes
        out = []
        for i in range(self.spikes):
            length = float(rng.uniform(*self.spike_s))
            start = self.warmup_s + i * slot + float(rng.uniform(0, max(0.0, slot - length)))
            out.append(Burst(start_s=round(start, 3), duration_s=round(length, 3), magnitude=self.burst_magnitude,
                             ramp_s=0.5))
        return out


def segment_bins(trace: Trace) -> tuple[int, ...]:
    """A loaded BurstGPT segment (already / 10) as its 1-second bins from its first request: the
    harness truncates each timestamp to whole seconds, then replays the gaps."""
    times = np.floor(np.array([r.arrival_s for r in trace.records], dtype=np.float64))
    if times.size == 0:
        raise ValueError("the BurstGPT segment has no requests")
    return tuple(int(c) for c in bin_counts(times - times.min()))


def build(w: Workload, dataset: str, scale: float, seed: int, *, spikes: bool = True) -> Trace:
    """The trace at upscaling factor `scale` (arrivals in whole seconds, as the harness sends them)."""
    rng = np.random.default_rng([seed, 0x4B554E])
    n = int(np.ceil(w.duration_s))
    long_counts = upscale_bins(rng.poisson(w.long_per_s, n), scale, rng)
    if w.bins is not None and spikes:
        seg = np.array(w.bins, dtype=np.int64)[: max(0, n - int(w.warmup_s))]
        short = np.concatenate([rng.poisson(w.short_per_s, int(w.warmup_s)), seg,
                                rng.poisson(w.short_per_s, max(0, n - int(w.warmup_s) - len(seg)))])
    else:
        short = spike_bins(rng, w.duration_s, w.short_per_s, w.spikes_at(seed) if spikes else [])
    short_counts = upscale_bins(short, scale, rng)
    t_long, t_short = bin_arrivals(long_counts), bin_arrivals(short_counts)
    p_long, _ = sample_lengths(dataset, rng, len(t_long))
    lo, hi = w.long_output
    o_long = rng.integers(lo, hi + 1, len(t_long))
    p_short, o_short = sample_lengths(dataset, rng, len(t_short))
    prompts = np.concatenate([p_long, p_short]).astype(np.int64)
    outputs = np.minimum(np.concatenate([o_long, o_short]), MAX_MODEL_LEN - prompts).astype(np.int64)
    times = np.concatenate([t_long, t_short])
    params = BurstGPTParams(seed=seed, duration_s=w.duration_s, rate=w.short_per_s * scale, bursts=w.spikes_at(seed)
                            if spikes else [], dataset=dataset, model=MODEL)  # type: ignore[arg-type]
    return make_trace(params, w.duration_s, times, [MODEL], np.zeros(len(times), np.int64), prompts, outputs)


def spike_windows(w: Workload, seed: int) -> list[tuple[float, float]]:
    """[start, end) of each spike (bins over 3x the base rate, for a real segment)."""
    if w.bins is None:
        return [(b.start_s, b.start_s + b.duration_s) for b in w.spikes_at(seed)]
    out: list[tuple[float, float]] = []
    for i, c in enumerate(w.bins):
        if c > 3 * w.short_per_s:
            t = w.warmup_s + i
            if out and out[-1][1] == t:
                out[-1] = (out[-1][0], t + 1)
            else:
                out.append((t, t + 1))
    return out


def burst_prefill_ratio(trace: Trace, windows: list[tuple[float, float]], instances: int,
                        prefill_per_token_s: float) -> float:
    """Prompt tokens arriving inside the spikes over what the cluster can prefill in that time:
    above 1 the spikes are a compute overload, not (only) a memory one."""
    span = sum(b - a for a, b in windows)
    if span <= 0:
        return 0.0
    tokens = sum(r.prompt_tokens for r in trace.records if any(a <= r.arrival_s < b for a, b in windows))
    return tokens * prefill_per_token_s / (instances * span)


__all__ = ["MODEL", "Workload", "build", "burst_prefill_ratio", "segment_bins", "spike_windows"]

"""A mixed many-model load (issue 21): the workload a memory economy must arbitrate.

Models: model i (1-based, in `models` order) gets a share of the requests proportional to
i ** -alpha (power-law popularity). Each follows its own diurnal curve,

    rate_i(t) = rate * share_i * (1 + A cos(2 pi (t / period - phase_i))) * burst_i(t)

with phase_i seeded uniform in +-`phase_spread` periods, so which models are hot drifts through the
day; burst_i(t) is `magnitude` on a burst's plateau (linear ramps), 1 elsewhere. Gaps between a
model's arrivals are gamma with coefficient of variation `cv` around that curve.

Adapters: each of `adapter_models` carries `adapters_per_model` LoRA adapters
(`<model>-lora-<j>`, ranks drawn uniformly from `ranks`); a share `adapter_fraction` of its
requests names one, chosen by Zipf popularity (rank k ~ k ** -zipf_s, a seeded permutation so names
carry no hint of popularity).

Lengths: short requests from `dataset` (KunServe Table 2's fits); a share `long_fraction` is
long: a draw of the same dataset with its prompt x `long_prompt_factor` and output x
`long_output_factor` (a synthetic long-context class: no published distribution is used).
`place_model_bursts` places seeded bursts on seeded models (never two at once).
"""
from __future__ import annotations

import numpy as np

from loadgen.traces.arrivals import arrivals
from loadgen.traces.azure import power_law_shares
from loadgen.traces.build import make_trace
from loadgen.traces.burstgpt import burst_envelope, place_bursts
from loadgen.traces.lengths import sample_lengths
from loadgen.traces.maf import zipf_probabilities
from loadgen.traces.schema import AdapterInfo, Burst, MixedParams, ModelBurst, Trace


def place_model_bursts(seed: int, duration_s: float, models: list[str], count: int, burst_duration_s: float,
                       magnitude: float, ramp_s: float = 2.0) -> list[ModelBurst]:
    """`count` bursts at seeded times (one per equal slot of the trace), each on a seeded model."""
    rng = np.random.default_rng([seed, 0x3B0])
    placed = place_bursts(seed, duration_s, count, burst_duration_s, magnitude, ramp_s)
    return [ModelBurst(model=models[int(rng.integers(len(models)))], start_s=b.start_s, duration_s=b.duration_s,
                       magnitude=b.magnitude, ramp_s=b.ramp_s) for b in placed]


def _check(p: MixedParams) -> None:
    if not p.models or len(set(p.models)) != len(p.models):
        raise ValueError(f"mixed: need at least one model and distinct names, got {p.models}")
    if p.rate <= 0 or p.period_s <= 0 or p.cv <= 0:
        raise ValueError(f"mixed: rate, period_s and cv must be > 0 (got {p.rate}, {p.period_s}, {p.cv})")
    if not 0 <= p.daily_amplitude <= 1:
        raise ValueError(f"mixed: daily_amplitude must be in [0, 1], got {p.daily_amplitude}")
    for name, v in (("adapter_fraction", p.adapter_fraction), ("long_fraction", p.long_fraction)):
        if not 0 <= v <= 1:
            raise ValueError(f"mixed: {name} must be in [0, 1], got {v}")
    unknown = [m for m in p.adapter_models + [b.model for b in p.bursts] if m not in p.models]
    if unknown:
        raise ValueError(f"mixed: adapter or burst model(s) {sorted(set(unknown))} are not among the models")
    if p.adapter_models and (p.adapters_per_model < 1 or not p.ranks):
        raise ValueError("mixed: adapter models need adapters_per_model >= 1 and at least one rank")
    for b in p.bursts:
        if b.magnitude < 0 or b.duration_s <= 0:
            raise ValueError(f"mixed: bad burst {b}: magnitude must be >= 0 and duration > 0")
    if p.long_prompt_factor < 1 or p.long_output_factor < 1:
        raise ValueError("mixed: long_prompt_factor and long_output_factor must be >= 1")


def _rate(p: MixedParams, share: float, phase: float, bursts: list[ModelBurst]):
    def rate(t: np.ndarray) -> np.ndarray:
        r = p.rate * share * (1 + p.daily_amplitude * np.cos(2 * np.pi * (t / p.period_s - phase)))
        for b in bursts:
            r = r * (1 + (b.magnitude - 1) * burst_envelope(t, Burst(start_s=b.start_s, duration_s=b.duration_s,
                                                                         magnitude=b.magnitude, ramp_s=b.ramp_s)))
        return r
    return rate


def generate_mixed(p: MixedParams) -> Trace:
    _check(p)
    rng = np.random.default_rng(p.seed)
    phases = rng.uniform(-p.phase_spread, p.phase_spread, len(p.models))
    dt = min([1.0] + [max(b.ramp_s, 0.01) / 10 for b in p.bursts])
    per_model = [arrivals(rng, _rate(p, float(share), float(phases[i]), [b for b in p.bursts if b.model == m]),
                          p.duration_s, dt=dt, cv=p.cv)
                 for i, (m, share) in enumerate(zip(p.models, power_law_shares(len(p.models), p.alpha)))]
    times = np.concatenate(per_model)
    model_idx = np.concatenate([np.full(len(t), i, np.int64) for i, t in enumerate(per_model)])
    n = len(times)

    names: list[str | None] = []
    infos: list[AdapterInfo] = []
    adapter_idx = np.full(n, -1, np.int64)
    width = len(str(max(p.adapters_per_model - 1, 0)))
    for m in p.adapter_models:
        first = len(names)
        names += [f"{m}-lora-{j:0{width}d}" for j in range(p.adapters_per_model)]
        infos += [AdapterInfo(name=str(names[first + j]), model=m, rank=int(r))
                  for j, r in enumerate(rng.choice(np.asarray(p.ranks), p.adapters_per_model))]
        by_rank = first + rng.permutation(p.adapters_per_model)  # popularity rank k -> adapter index
        mine = np.flatnonzero((model_idx == p.models.index(m)) & (rng.random(n) < p.adapter_fraction))
        picks = rng.choice(p.adapters_per_model, len(mine), p=zipf_probabilities(p.adapters_per_model, p.zipf_s))
        adapter_idx[mine] = by_rank[picks]
    names.append(None)
    adapter_idx[adapter_idx < 0] = len(names) - 1

    prompts, outputs = sample_lengths(p.dataset, rng, n)
    long = rng.random(n) < p.long_fraction
    prompts = np.where(long, np.rint(prompts * p.long_prompt_factor), prompts).astype(np.int64)
    outputs = np.where(long, np.rint(outputs * p.long_output_factor), outputs).astype(np.int64)
    return make_trace(p, p.duration_s, times, p.models, model_idx, prompts, outputs, names, adapter_idx, infos)


__all__ = ["generate_mixed", "place_model_bursts"]

"""MAF-like adapter popularity (CaraServe §7.1, §7.5).

`adapters` LoRA adapters whose invocation probabilities follow a Zipf law over their
popularity rank (p_k ~ k ** -zipf_s; the MAF function-invocation frequencies are this
skewed), Poisson arrivals at the aggregate `rate`. Adapters are spread over the base
models at random (CaraServe groups them at random), each with a rank drawn from `ranks`;
names carry no hint of popularity (a seeded permutation). The header lists every adapter.
"""
from __future__ import annotations

import numpy as np

from loadgen.traces.arrivals import arrivals, constant_rate
from loadgen.traces.build import make_trace
from loadgen.traces.lengths import sample_lengths
from loadgen.traces.schema import AdapterInfo, MAFParams, Trace


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -s
    return weights / weights.sum()


def generate_maf(params: MAFParams) -> Trace:
    if params.adapters < 1 or not params.models or not params.ranks:
        raise ValueError("maf: need adapters >= 1, at least one model and one rank")
    if not 0 <= params.base_fraction <= 1:
        raise ValueError(f"maf: base_fraction must be in [0, 1], got {params.base_fraction}")
    rng = np.random.default_rng(params.seed)
    width = len(str(params.adapters - 1))
    names = [f"adapter-{j:0{width}d}" for j in range(params.adapters)]
    by_rank = rng.permutation(params.adapters)  # popularity rank k -> adapter index
    adapter_model = rng.integers(0, len(params.models), params.adapters)
    adapter_rank = rng.choice(np.asarray(params.ranks), params.adapters)
    infos = [AdapterInfo(name=names[j], model=params.models[int(adapter_model[j])], rank=int(adapter_rank[j]))
             for j in range(params.adapters)]

    times = arrivals(rng, constant_rate(params.rate), params.duration_s)
    n = len(times)
    picked = by_rank[rng.choice(params.adapters, n, p=zipf_probabilities(params.adapters, params.zipf_s))]
    base_only = rng.random(n) < params.base_fraction
    model_idx = np.where(base_only, rng.integers(0, len(params.models), n), adapter_model[picked])
    adapter_names: list[str | None] = [*names, None]
    adapter_idx = np.where(base_only, params.adapters, picked)
    prompts, outputs = sample_lengths(params.dataset, rng, n)
    return make_trace(params, params.duration_s, times, params.models, model_idx, prompts, outputs,
                      adapter_names, adapter_idx, infos)

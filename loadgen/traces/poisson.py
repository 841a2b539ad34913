"""Plain Poisson arrivals at rate lambda, lengths from a dataset or fixed."""
from __future__ import annotations

import numpy as np

from loadgen.traces.arrivals import arrivals, constant_rate
from loadgen.traces.build import make_trace
from loadgen.traces.lengths import sample_lengths
from loadgen.traces.schema import PoissonParams, Trace


def generate_poisson(params: PoissonParams) -> Trace:
    rng = np.random.default_rng(params.seed)
    times = arrivals(rng, constant_rate(params.rate), params.duration_s)
    n = len(times)
    prompts, outputs = sample_lengths(params.dataset, rng, n)
    for fixed, name in ((params.prompt_tokens, "prompt_tokens"), (params.output_tokens, "output_tokens")):
        if fixed is not None and fixed < 1:
            raise ValueError(f"poisson: {name} must be >= 1, got {fixed}")
    if params.prompt_tokens is not None:
        prompts = np.full(n, params.prompt_tokens, np.int64)
    if params.output_tokens is not None:
        outputs = np.full(n, params.output_tokens, np.int64)
    return make_trace(params, params.duration_s, times, [params.model], np.zeros(n, np.int64), prompts, outputs)

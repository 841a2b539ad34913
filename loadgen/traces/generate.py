"""One entry point: a generator's parameters in, a `Trace` out (seeded, deterministic)."""
from __future__ import annotations

from loadgen.traces.azure import generate_azure
from loadgen.traces.burstgpt import generate_burstgpt
from loadgen.traces.maf import generate_maf
from loadgen.traces.mixed import generate_mixed
from loadgen.traces.poisson import generate_poisson
from loadgen.traces.prefix import generate_prefix_chat, generate_prefix_system
from loadgen.traces.schema import (
    AzureParams, BurstGPTParams, MAFParams, MixedParams, PoissonParams, PrefixChatParams, PrefixSystemParams, Trace,
)


def generate(params: BurstGPTParams | AzureParams | MAFParams | PoissonParams | MixedParams | PrefixChatParams
             | PrefixSystemParams) -> Trace:
    if params.duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {params.duration_s}")
    if isinstance(params, BurstGPTParams):
        return generate_burstgpt(params)
    if isinstance(params, AzureParams):
        return generate_azure(params)
    if isinstance(params, MAFParams):
        return generate_maf(params)
    if isinstance(params, PoissonParams):
        return generate_poisson(params)
    if isinstance(params, MixedParams):
        return generate_mixed(params)
    if isinstance(params, PrefixChatParams):
        return generate_prefix_chat(params)
    if isinstance(params, PrefixSystemParams):
        return generate_prefix_system(params)
    raise TypeError(f"no generator for {type(params).__name__}")

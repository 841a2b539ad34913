"""The wire's `SamplingParams` (shared/events) as the engine's (engine/sampling_params.py)."""
from __future__ import annotations

from services.gpu_worker.engine.sampling_params import SamplingParams
from shared.events import SamplingParams as WireSamplingParams


def engine_params(p: WireSamplingParams) -> SamplingParams:
    """The wire's sampling parameters as the engine's (raises SamplingParamsError if inconsistent)."""
    return SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
        logprobs=p.logprobs, include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty, min_p=p.min_p,
        logit_bias=tuple((b.token_id, b.bias) for b in p.logit_bias),
        guided=(p.guided.kind, p.guided.spec) if p.guided is not None else None,
    )

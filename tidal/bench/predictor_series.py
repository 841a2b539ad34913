"""Per-model load series from a trace, for `tidal bench predictor`: arrival rate and concurrency.

Rate: the live predictor's definitions (services/predictor/windows.py): avg = arrivals / window,
peak = the busiest `slot` of the window. Concurrency (WarmServe's load): the requests in the
system, each held for a service time read from its lengths on an uncongested server,
`prompt / prefill_tps + output x tpot_s` (`request_s` when the trace has no lengths); avg = the
time-mean over the window, peak = the busiest slot's time-mean.

The Azure-like week (loadgen/traces/azure.py's rate curves, arrival process and length
distributions) is built here as columns, without Trace records: a week at 8 req/s is 4.8 M requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.traces.arrivals import arrivals
from loadgen.traces.azure import model_rate, power_law_shares
from loadgen.traces.generate import generate
from loadgen.traces.lengths import sample_lengths
from loadgen.traces.mixed import place_model_bursts
from loadgen.traces.schema import AzureParams, MixedParams
from services.predictor.windows import series_from_arrivals

SERIES = ("rate_avg", "rate_peak", "conc_avg", "conc_peak")


@dataclass(frozen=True)
class ModelRequests:
    arrivals: np.ndarray  # seconds from the trace's start, sorted
    prompt_tokens: np.ndarray | None = None  # None: the trace records no lengths
    output_tokens: np.ndarray | None = None


@dataclass(frozen=True)
class ServiceModel:
    prefill_tps: float = 8_000.0  # prompt tokens per second
    tpot_s: float = 0.025  # seconds per output token
    request_s: float = 2.0  # a request's time when the trace has no lengths ([planner] request_time)

    def durations(self, req: ModelRequests) -> np.ndarray:
        if req.prompt_tokens is None or req.output_tokens is None:
            return np.full(len(req.arrivals), self.request_s)
        return req.prompt_tokens / self.prefill_tps + req.output_tokens * self.tpot_s


def busy_integral(starts: np.ndarray, ends: np.ndarray, at: np.ndarray) -> np.ndarray:
    """F(t) = the integral of the number of requests in the system over [0, t], at each of `at`."""
    s, e = np.sort(starts), np.sort(ends)
    cs, ce = np.concatenate(([0.0], np.cumsum(s))), np.concatenate(([0.0], np.cumsum(e)))
    ns, ne = np.searchsorted(s, at), np.searchsorted(e, at)
    return (ns * at - cs[ns]) - (ne * at - ce[ne])


def concurrency_series(starts: np.ndarray, durations: np.ndarray, window_s: float, slot_s: float,
                       windows: int) -> tuple[list[float], list[float]]:
    """Mean and busiest-slot concurrency per window, windows from t = 0."""
    slots = max(1, round(window_s / slot_s))
    slot_len = window_s / slots
    edges = np.arange(windows * slots + 1) * slot_len
    per_slot = np.diff(busy_integral(starts, starts + durations, edges)).reshape(windows, slots) / slot_len
    return per_slot.mean(axis=1).tolist(), per_slot.max(axis=1).tolist()


def load_series(req: ModelRequests, window_s: float, slot_s: float, windows: int,
                service: ServiceModel) -> dict[str, list[float]]:
    rate_avg, rate_peak = series_from_arrivals(req.arrivals, window_s, slot_s, windows)
    conc_avg, conc_peak = concurrency_series(req.arrivals, service.durations(req), window_s, slot_s, windows)
    return {"rate_avg": rate_avg, "rate_peak": rate_peak, "conc_avg": conc_avg, "conc_peak": conc_peak}


def azure_like(kind: str, rate: float, days: float, alpha: float, cv: float, seed: int) -> dict[str, ModelRequests]:
    """Requests per model from the Azure-like generator's rate curves and length distributions."""
    params = AzureParams(seed=seed, duration_s=days * 86_400.0, rate=rate, alpha=alpha, kinds=[kind], cv=cv)  # type: ignore[list-item]
    rng = np.random.default_rng(seed)
    jitter = rng.uniform(-params.phase_jitter_h, params.phase_jitter_h, len(params.models))
    out = {}
    for i, share in enumerate(power_law_shares(len(params.models), alpha)):
        curve = model_rate(params, float(share), params.peak_hour + float(jitter[i]))
        times = arrivals(rng, curve, params.duration_s, dt=60.0, cv=cv)
        prompts, outputs = sample_lengths("azureconv" if kind == "conv" else "azurecode", rng, len(times))
        out[params.models[i]] = ModelRequests(times, prompts, outputs)
    return out


def mixed_hour(seed: int) -> tuple[dict[str, ModelRequests], float]:
    """`tidal trace mixed` with its defaults (an hour, 8 models, a compressed 1 h day, 3 bursts), per model."""
    models = [f"model-{i}" for i in range(8)]
    trace = generate(MixedParams(seed=seed, duration_s=3600.0, period_s=3600.0, models=models,
                                 bursts=place_model_bursts(seed, 3600.0, models, 3, 60.0, 8.0)))
    per: dict[str, list[tuple[float, int, int]]] = {}
    for r in trace.records:
        per.setdefault(r.model, []).append((r.arrival_s, r.prompt_tokens, r.output_tokens))
    out = {}
    for model, rows in per.items():
        cols = np.asarray(rows, dtype=np.float64)
        out[model] = ModelRequests(cols[:, 0], cols[:, 1], cols[:, 2])
    return out, trace.header.duration_s


__all__ = ["SERIES", "ModelRequests", "ServiceModel", "azure_like", "busy_integral", "concurrency_series",
           "load_series", "mixed_hour"]

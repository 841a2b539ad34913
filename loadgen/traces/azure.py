"""Azure-like multi-model load with daily and weekly periodicity (WarmServe §7.1).

Model i (1-based) gets a share of the requests proportional to i ** -alpha (the power law
WarmServe takes from MuxServe: alpha = 2 over four models gives the first one 70.2%).
Each model's rate follows

    rate_i(t) = rate * share_i * (1 + A cos(2 pi (h(t) - peak_i) / 24)) * week(t) / mean(week)

where h(t) is the hour of day, peak_i is `peak_hour` shifted per model by a seeded offset
in +-`phase_jitter_h`, and week(t) is 1 on weekdays and `weekend_factor` on Saturday and
Sunday (the trace starts at 00:00 on a Monday). `rate` is thus the mean over a whole
week. A model's kind (conv or code) picks its length distribution (azureconv/azurecode).
"""
from __future__ import annotations

import numpy as np

from loadgen.traces.arrivals import arrivals
from loadgen.traces.build import make_trace
from loadgen.traces.lengths import sample_lengths
from loadgen.traces.schema import AzureParams, Trace

DAY_S = 86_400.0
WEEK_S = 7 * DAY_S


def power_law_shares(n: int, alpha: float) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return weights / weights.sum()


def week_factor(t: np.ndarray, weekend_factor: float) -> np.ndarray:
    day = np.floor((t % WEEK_S) / DAY_S)
    return np.where(day >= 5, weekend_factor, 1.0)


def model_rate(params: AzureParams, share: float, peak_hour: float):
    mean_week = (5 + 2 * params.weekend_factor) / 7

    def rate(t: np.ndarray) -> np.ndarray:
        hour = (t % DAY_S) / 3600.0
        daily = 1 + params.daily_amplitude * np.cos(2 * np.pi * (hour - peak_hour) / 24.0)
        return params.rate * share * daily * week_factor(t, params.weekend_factor) / mean_week
    return rate


def generate_azure(params: AzureParams) -> Trace:
    if not params.models or not params.kinds:
        raise ValueError("azure: need at least one model and one kind")
    if not 0 <= params.daily_amplitude <= 1 or params.weekend_factor < 0 or params.rate <= 0:
        raise ValueError("azure: need 0 <= daily_amplitude <= 1, weekend_factor >= 0, rate > 0")
    rng = np.random.default_rng(params.seed)
    shares = power_law_shares(len(params.models), params.alpha)
    jitter = rng.uniform(-params.phase_jitter_h, params.phase_jitter_h, len(params.models))
    cols: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for i, share in enumerate(shares):
        times = arrivals(rng, model_rate(params, float(share), params.peak_hour + float(jitter[i])),
                         params.duration_s, dt=min(60.0, params.duration_s / 1000), cv=params.cv)
        kind = params.kinds[i % len(params.kinds)]
        prompts, outputs = sample_lengths("azureconv" if kind == "conv" else "azurecode", rng, len(times))
        cols.append((times, np.full(len(times), i, np.int64), prompts, outputs))
    times, model_idx, prompts, outputs = (np.concatenate([c[k] for c in cols]) for k in range(4))
    return make_trace(params, params.duration_s, times, params.models, model_idx, prompts, outputs)

"""WarmServe §7.1's setting for `tidal repro warmserve`: workloads, systems, forecasts.

Workloads. Four models (Table 1, in the fleet profile) get request rates by a power law over
their rank (share of model i proportional to i^-alpha; alpha = 2 gives Llama2-7B-0 70.2% of
the requests, as §7.3 reports), scaled so the mean total rate is RPS. The paper samples each
model's requests from a different day of the Azure trace; here each model follows the
Azure-like daily curve (loadgen/traces/azure.py: 1 + A cos(2 pi (h - peak_i) / 24)) with its
own seeded peak hour (uniform in 14 +- 6 h: our assumption), so popularity shifts over the run.
One simulated day is compressed into `day_s` seconds (an hour at paper scale: 24x), with gamma
inter-arrival gaps (cv > 1: Azure's short-term bursts) and AzureConv / AzureCode lengths. The
paper publishes neither its replay length nor any time compression (§7.1); §2.2's "8x Speed" is
an inference speed (each request's running time), not a trace compression. The 24x is ours; the
proactive-prewarming gap here does not depend on it (docs/benchmarks.md "## repro warmserve").

Forecasts. CSP (Eqs. 2-4, shared/policy/warmserve_predictor.py) per window of `window_s`
over `history_days` earlier days drawn from the same curves with other seeds, plus the run's
own windows so far; loads are concurrent requests (Little's law over the arrivals with each
model's mean request time on its instance, as the live predictor turns rates into loads).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.sim.fleet_profile import FleetModel, FleetProfile
from loadgen.sim.fleet_state import FleetSystem
from loadgen.traces.arrivals import arrivals
from loadgen.traces.azure import power_law_shares
from loadgen.traces.build import make_trace
from loadgen.traces.lengths import dataset_lengths, sample_lengths
from loadgen.traces.schema import AzureParams, Trace
from shared.policy.warmserve_predictor import CspParams, LoadForecast, forecast

DAY_H = 24.0


@dataclass(frozen=True)
class Workload:
    key: str
    dataset: str  # azureconv | azurecode (lengths)
    alpha: float
    cv: float  # inter-arrival burstiness (gamma gaps)
    figure: str  # the paper's figures for this setting

    @property
    def title(self) -> str:
        return f"{'AzureConv' if self.dataset == 'azureconv' else 'AzureCode'}, alpha={self.alpha}"


WORKLOADS: dict[str, Workload] = {
    "conv-a0.5": Workload("conv-a0.5", "azureconv", 0.5, 2.0, "Fig. 9 (alpha=0.5), 11, 13"),
    "conv-a2.0": Workload("conv-a2.0", "azureconv", 2.0, 2.0, "Fig. 9 (alpha=2.0), 11, 17"),
    "code-a0.5": Workload("code-a0.5", "azurecode", 0.5, 3.0, "Figs. 14, 15"),
}

# MuxServe's placements as §7.3 describes them (Fig. 10): for alpha=0.5 it co-locates 7B-0 and
# 70B on 8 GPUs; for alpha=2.0, 7B-0, 7B-1 and 13B share 8 GPUs. The rest runs alone.
MUXSERVE_MESHES: dict[float, list[tuple[tuple[int, ...], tuple[str, ...]]]] = {
    0.5: [(tuple(range(8)), ("llama2-7b-0", "llama2-70b")), (tuple(range(8, 12)), ("llama2-7b-1",)),
          (tuple(range(12, 16)), ("llama2-13b",))],
    2.0: [(tuple(range(8)), ("llama2-7b-0", "llama2-7b-1", "llama2-13b")), (tuple(range(8, 16)), ("llama2-70b",))],
}


def systems(keep_alive_s: float) -> dict[str, FleetSystem]:
    """The four systems of §7.3: WarmServe, WarmServe without proactive prewarming, SLLM-GPU."""
    return {
        "WarmServe": FleetSystem("WarmServe", prewarm="proactive", keep_alive_s=keep_alive_s),
        "WarmServe-noproactive": FleetSystem("WarmServe-noproactive", prewarm="reactive", keep_alive_s=keep_alive_s),
        "SLLM-GPU": FleetSystem("SLLM-GPU", prewarm="none", engine_pool=False, keep_alive_s=keep_alive_s),
    }


def mean_request_s(profile: FleetProfile, m: FleetModel, dataset: str) -> float:
    """A request's mean time on an instance: its prefill, then its decode steps at half the batch."""
    prompt, output = (float(d.mean()) for d in dataset_lengths(dataset))
    prompt = min(prompt, m.max_model_len - 1)
    cost = profile.step_cost(m)
    half = m.batch_size / 2
    return prompt * cost.prefill_per_token_s + output * cost.step_s(int(half), int(half * (prompt + output / 2)))


def peak_hours(models: int, seed: int) -> np.ndarray:
    return 14.0 + np.random.default_rng(seed).uniform(-6.0, 6.0, models)


def rate_fn(rate: float, peak_h: float, day_s: float, amplitude: float = 0.6):
    def fn(t: np.ndarray) -> np.ndarray:
        hour = (t / day_s) * DAY_H
        return rate * (1 + amplitude * np.cos(2 * np.pi * (hour - peak_h) / DAY_H))
    return fn


def model_arrivals(names: list[str], shares: np.ndarray, peaks: np.ndarray, rps: float, day_s: float,
                   cv: float, rng: np.random.Generator) -> list[np.ndarray]:
    return [arrivals(rng, rate_fn(rps * float(s), float(p), day_s), day_s, dt=day_s / 2000, cv=cv)
            for s, p in zip(shares, peaks)]


def build_trace(profile: FleetProfile, w: Workload, rps: float, day_s: float, seed: int) -> Trace:
    names = [m.name for m in profile.models]
    rng = np.random.default_rng(seed * 7919 + int(rps * 100))
    times = model_arrivals(names, power_law_shares(len(names), w.alpha), peak_hours(len(names), seed), rps,
                           day_s, w.cv, rng)
    idx = np.concatenate([np.full(len(t), k, np.int64) for k, t in enumerate(times)])
    prompts, outputs = sample_lengths(w.dataset, rng, len(idx))
    params = AzureParams(seed=seed, duration_s=day_s, rate=rps, models=names, alpha=w.alpha,
                         kinds=["conv" if w.dataset == "azureconv" else "code"], cv=w.cv)
    return make_trace(params, day_s, np.concatenate(times), names, idx, prompts, outputs)


def window_loads(times: np.ndarray, day_s: float, window_s: float, req_s: float) -> tuple[list[float], list[float]]:
    """(avg, peak) concurrent requests per window of one day's arrivals of one model, each request
    taken to run `req_s` (§2.2: "the running time of a request is computed from its lengths")."""
    n = int(round(day_s / window_s))
    times = np.sort(times)
    avg = np.histogram(times, bins=n, range=(0.0, n * window_s))[0] / window_s * req_s
    # concurrency just after each arrival: the requests that arrived within the last req_s
    conc = np.arange(1, len(times) + 1) - np.searchsorted(times, times - req_s, side="right")
    peak = np.zeros(n)
    np.maximum.at(peak, np.minimum((times // window_s).astype(np.int64), n - 1), conc)
    return avg.tolist(), np.maximum(peak, avg).tolist()


def forecasts(profile: FleetProfile, w: Workload, trace: Trace, rps: float, day_s: float, window_s: float,
              history_days: int, seed: int) -> dict[str, list[LoadForecast]]:
    """Per model, the CSP forecast of each window of the run, from the days before and the run so far."""
    names = [m.name for m in profile.models]
    shares, peaks = power_law_shares(len(names), w.alpha), peak_hours(len(names), seed)
    req_s = {m.name: mean_request_s(profile, m, w.dataset) for m in profile.models}
    history: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    for day in range(history_days):
        rng = np.random.default_rng(10_000 + seed * 31 + day)
        for name, t in zip(names, model_arrivals(names, shares, peaks, rps, day_s, w.cv, rng)):
            avg, peak = window_loads(t, day_s, window_s, req_s[name])
            history[name][0].extend(avg)
            history[name][1].extend(peak)
    times = {n: np.array([r.arrival_s for r in trace.records if r.model == n]) for n in names}
    per_day = int(round(day_s / window_s))
    params = CspParams(windows_per_season=per_day)
    out: dict[str, list[LoadForecast]] = {}
    for name in names:
        avg, peak = window_loads(times[name], day_s, window_s, req_s[name])
        h_avg, h_peak = history[name]
        out[name] = [forecast(h_avg + avg[:k], h_peak + peak[:k], len(h_avg) + k, params) for k in range(per_day)]
    return out

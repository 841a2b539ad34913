"""Each generator reproduces its target statistics (tolerances stated per test)."""
from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.azure import DAY_S, power_law_shares
from loadgen.traces.burstgpt import place_bursts
from loadgen.traces.generate import generate
from loadgen.traces.lengths import DATASETS
from loadgen.traces.maf import zipf_probabilities
from loadgen.traces.schema import AzureParams, Burst, BurstGPTParams, MAFParams, PoissonParams
from loadgen.traces.summary import summarize


def arrival_times(trace) -> np.ndarray:
    return np.array([r.arrival_s for r in trace.records])


# --- BurstGPT-like -------------------------------------------------------------------
def test_burst_magnitude_and_ramp_within_seconds() -> None:
    burst = Burst(start_s=200.0, duration_s=40.0, magnitude=14.0, ramp_s=2.0)
    trace = generate(BurstGPTParams(seed=1, duration_s=400.0, rate=5.0, bursts=[burst]))
    t = arrival_times(trace)
    base = np.sum(t < 190) / 190.0
    plateau = np.sum((t >= 202) & (t < 238)) / 36.0
    assert base == pytest.approx(5.0, rel=0.1)
    assert plateau / base == pytest.approx(14.0, rel=0.1)  # burst magnitude within 10%
    # "within seconds": 3 s after the burst starts the rate is already at the plateau
    assert np.sum((t >= 203) & (t < 213)) / 10.0 / base > 11.0
    after = np.sum((t >= 250) & (t < 400)) / 150.0
    assert after == pytest.approx(5.0, rel=0.15)


def test_burstgpt_lengths_follow_the_dataset_and_runs_are_reproducible() -> None:
    params = BurstGPTParams(seed=3, duration_s=600.0, rate=20.0, dataset="agieval-cot",
                            bursts=place_bursts(3, 600.0, 2, 30.0, 14.0))
    a, b = generate(params), generate(params)
    assert a.records == b.records  # seeded: the same trace twice
    assert generate(BurstGPTParams(seed=4, duration_s=600.0, rate=20.0)).records != a.records
    s = summarize(a)
    target = DATASETS["agieval-cot"]
    assert s.prompt.mean == pytest.approx(target.prompt.mean, rel=0.1)
    assert s.output.p50 == pytest.approx(target.output.p50, rel=0.1)
    assert s.output.p99 == pytest.approx(target.output.p99, rel=0.1)
    assert len(params.bursts) == 2 and params.bursts[0].start_s + 30 < params.bursts[1].start_s


def test_gamma_gaps_make_arrivals_burstier_at_the_same_rate() -> None:
    def dispersion(cv: float) -> tuple[float, float]:
        t = arrival_times(generate(BurstGPTParams(seed=5, duration_s=2000.0, rate=5.0, cv=cv)))
        counts = np.bincount(t.astype(int), minlength=2000)
        return counts.mean(), counts.var() / counts.mean()
    mean1, d1 = dispersion(1.0)
    mean3, d3 = dispersion(3.0)
    assert mean1 == pytest.approx(5.0, rel=0.05) and mean3 == pytest.approx(5.0, rel=0.15)
    assert d1 == pytest.approx(1.0, abs=0.15)  # Poisson: variance = mean
    assert d3 > 3.0


# --- Azure-like ----------------------------------------------------------------------
def test_power_law_exponent_fits_back() -> None:
    models = [f"m{i}" for i in range(8)]
    trace = generate(AzureParams(seed=2, duration_s=DAY_S, rate=1.0, models=models, alpha=1.2))
    counts = np.array([summarize(trace).models[m] for m in models], dtype=float)
    slope = np.polyfit(np.log(np.arange(1, 9)), np.log(counts), 1)[0]
    assert -slope == pytest.approx(1.2, abs=0.1)


def test_alpha_two_gives_warmserve_share() -> None:
    # WarmServe §7.3: with alpha = 2 the first of four models takes 70.2% of requests
    assert power_law_shares(4, 2.0)[0] == pytest.approx(0.702, abs=0.001)
    trace = generate(AzureParams(seed=2, duration_s=DAY_S, rate=0.5, alpha=2.0))
    assert summarize(trace).models["model-0"] / len(trace.records) == pytest.approx(0.702, abs=0.02)


def test_daily_and_weekly_periodicity() -> None:
    params = AzureParams(seed=9, duration_s=7 * DAY_S, rate=0.15, models=["m"], daily_amplitude=0.6,
                         peak_hour=14.0, weekend_factor=0.6, phase_jitter_h=0.0)
    t = arrival_times(generate(params))
    hourly = np.bincount((t // 3600).astype(int), minlength=168)[:168].astype(float)
    spectrum = np.abs(np.fft.rfft(hourly - hourly.mean()))
    assert int(np.argmax(spectrum)) == 7  # 7 cycles per week: the daily period
    hour_of_day = (t % DAY_S) / 3600
    peak = np.sum(np.abs(hour_of_day - 14) < 2)
    trough = np.sum(np.abs(hour_of_day - 2) < 2)
    assert peak / trough == pytest.approx(3.68, rel=0.15)  # (1 + 0.6 * 0.955) / (1 - 0.6 * 0.955)
    daily = np.bincount((t // DAY_S).astype(int), minlength=7)[:7]
    assert daily[5:].mean() / daily[:5].mean() == pytest.approx(0.6, rel=0.1)  # weekend factor
    assert len(t) / (7 * DAY_S) == pytest.approx(0.15, rel=0.05)  # `rate` is the weekly mean


def test_code_models_use_code_lengths() -> None:
    trace = generate(AzureParams(seed=1, duration_s=DAY_S / 4, rate=2.0, models=["conv", "code"], alpha=0.0,
                                 kinds=["conv", "code"]))
    outs = {m: np.median([r.output_tokens for r in trace.records if r.model == m]) for m in ("conv", "code")}
    assert outs["conv"] == pytest.approx(DATASETS["azureconv"].output.p50, rel=0.1)
    assert outs["code"] == pytest.approx(DATASETS["azurecode"].output.p50, rel=0.15)


# --- MAF-like ------------------------------------------------------------------------
def test_maf_zipf_skew_over_thousands_of_adapters() -> None:
    params = MAFParams(seed=4, duration_s=600.0, rate=100.0, adapters=3000, zipf_s=1.0, models=["a", "b"])
    trace = generate(params)
    names = [r.adapter for r in trace.records]
    assert all(n is not None for n in names)
    _, counts = np.unique(np.array(names), return_counts=True)
    ranked = np.sort(counts)[::-1].astype(float)
    slope = np.polyfit(np.log(np.arange(1, 41)), np.log(ranked[:40]), 1)[0]
    assert -slope == pytest.approx(1.0, abs=0.1)  # Zipf exponent fitted back
    top_share = ranked[0] / len(names)
    assert top_share == pytest.approx(zipf_probabilities(3000, 1.0)[0], rel=0.1)
    assert len(counts) > 1000  # thousands of adapters, a long tail
    assert len(trace.header.adapters) == 3000
    by_name = {a.name: a for a in trace.header.adapters}
    assert all(by_name[r.adapter].model == r.model for r in trace.records)  # an adapter serves one base model
    assert {a.rank for a in trace.header.adapters} == {8, 16, 32, 64}
    gaps = np.diff(arrival_times(trace))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # Poisson arrivals


def test_maf_base_fraction() -> None:
    trace = generate(MAFParams(seed=1, duration_s=200.0, rate=50.0, adapters=100, base_fraction=0.25))
    share = sum(r.adapter is None for r in trace.records) / len(trace.records)
    assert share == pytest.approx(0.25, abs=0.03)


# --- Poisson -------------------------------------------------------------------------
def test_poisson_rate_gaps_and_fixed_lengths() -> None:
    trace = generate(PoissonParams(seed=8, duration_s=1000.0, rate=4.0, prompt_tokens=32, output_tokens=8))
    n = len(trace.records)
    assert abs(n - 4000) < 4 * np.sqrt(4000)
    gaps = np.diff(arrival_times(trace))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    assert {(r.prompt_tokens, r.output_tokens) for r in trace.records} == {(32, 8)}
    assert [r.request_id for r in trace.records[:2]] == ["req-0", "req-1"]
    with pytest.raises(ValueError, match="duration must be > 0"):
        generate(PoissonParams(duration_s=0.0))

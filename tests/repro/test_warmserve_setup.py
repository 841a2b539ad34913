"""WarmServe §7.1's setting from the real Azure LLM 2023 hours (loadgen/repro/warmserve_setup.py): the public
code's sampling (power-law counts, repeated rows drawn without replacement, the 1,024-token input cap), every
model's own window of the trace with its real history, the window loads the forecasters are fed, and the
forecasts (loadgen/repro/warmserve_forecast.py). Fixture: tests/repro/data/azure-llm-2023-sample/
(every tenth request of the real hours; CC-BY 4.0, Patel et al., Splitwise, ISCA 2024)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadgen.repro.warmserve_forecast import forecasts
from loadgen.repro.warmserve_setup import (
    INPUT_CAP, WORKLOADS, build_trace, load_hour, model_requests, model_starts, sample_span, systems, window_loads,
)
from loadgen.sim.fleet_profile import load_fleet_profile
from loadgen.traces.azure import power_law_shares

SAMPLE = str(Path(__file__).with_name("data") / "azure-llm-2023-sample")


@pytest.fixture(scope="module")
def profile():
    return load_fleet_profile("warmserve-h800-llama2")


def test_each_model_gets_its_power_law_share_of_rps_x_the_replay(profile) -> None:
    trace = build_trace(profile, WORKLOADS["conv-a2.0"], 10.0, seed=0, azure_dir=SAMPLE, duration_s=1200.0)
    counts = {m.name: sum(1 for r in trace.records if r.model == m.name) for m in profile.models}
    shares = power_law_shares(4, 2.0)
    assert round(float(shares[0]), 3) == 0.702  # §7.3: 7B-0 gets 70.2% at alpha 2
    assert counts == {m.name: int(10.0 * 1200 * float(s)) for m, s in zip(profile.models, shares)}
    assert trace.header.duration_s == 1200.0
    assert all(0 <= r.arrival_s < 1200 for r in trace.records)
    assert all(r.prompt_tokens <= INPUT_CAP and 3 <= r.output_tokens <= 1023 for r in trace.records)


def test_every_model_replays_its_own_window_of_the_real_trace(profile) -> None:
    hour = load_hour("conv", SAMPLE)
    starts = model_starts(hour, 4, 1200.0, 900.0)
    assert starts[0] == 900.0 and starts[-1] == pytest.approx(float(hour.times.max()) - 1200.0)
    assert len(set(starts)) == 4 and starts == sorted(starts)  # four different stretches of the service
    parts = model_requests(profile, WORKLOADS["conv-a0.5"], 5.0, 0, 1200.0, 900.0, SAMPLE)
    for (times, _, _), start in zip(parts, starts):  # each model's arrivals are its own window's real instants
        real = hour.times[(hour.times >= start) & (hour.times < start + 1200.0)] - start
        assert set(np.round(times, 6)) <= set(np.round(real, 6))
    history = model_requests(profile, WORKLOADS["conv-a0.5"], 5.0, 0, 1200.0, 900.0, SAMPLE, window_s=300.0)
    for (times, _, _), start in zip(history, starts):  # the history: the whole windows before it, never after
        lo = start - (start // 300.0) * 300.0
        real = hour.times[(hour.times >= lo) & (hour.times < start)] - lo
        assert len(times) and set(np.round(times, 6)) <= set(np.round(real, 6))
        assert times.max() < start - lo
    with pytest.raises(ValueError, match="do not fit"):
        model_starts(hour, 4, 3000.0, 900.0)


def test_rows_are_repeated_then_drawn_without_replacement() -> None:
    hour = load_hour("code", SAMPLE)
    rows = int(((hour.times >= 600.0) & (hour.times < 1200.0)).sum())
    n = 3 * rows + 5  # more requests than rows: every row 4 times, n of them drawn
    times, prompts, outputs = sample_span(hour, 600.0, 1200.0, n, np.random.default_rng(1))
    assert len(times) == n and (np.diff(times) >= 0).all() and 0 <= times.min() and times.max() < 600.0
    drawn = np.unique(times, return_counts=True)[1]
    assert drawn.max() <= 4 * np.unique(hour.times, return_counts=True)[1].max()
    assert set(np.round(times + 600.0, 6)) <= set(np.round(hour.times, 6))  # real arrival instants, uncompressed


def test_window_loads_on_worked_numbers() -> None:
    # requests at 0 s (10 s long), 5 s (10 s) and 30 s (5 s); windows of 10 s over 40 s
    avg, peak = window_loads(np.array([0.0, 5.0, 30.0]), np.array([10.0, 10.0, 5.0]), 40.0, 10.0)
    assert avg == pytest.approx([1.5, 0.5, 0.0, 0.5])  # 0-5: 1, 5-10: 2 | 10-15: 1 | - | 30-35: 1
    assert peak == pytest.approx([2, 1, 0, 1])


@pytest.mark.parametrize("forecaster", ["ensemble", "csp"])
def test_forecasts_read_each_models_real_history_then_the_run(profile, forecaster) -> None:
    w = WORKLOADS["conv-a0.5"]
    trace = build_trace(profile, w, 5.0, seed=0, azure_dir=SAMPLE, duration_s=1200.0)
    fc = forecasts(profile, w, trace, 5.0, 300.0, 0, SAMPLE, 900.0, forecaster)
    assert set(fc.per_model) == {m.name for m in profile.models} and fc.forecaster == forecaster
    assert all(len(series) == 4 for series in fc.per_model.values())  # 20 minutes of 5-minute windows
    assert all(f.peak >= f.avg >= 0 for series in fc.per_model.values() for f in series)
    assert fc.history_windows["llama2-7b-0"] == 3 and fc.history_windows["llama2-70b"] > 3  # later windows, more history
    avg_err, peak_err = fc.error()
    assert 0 <= avg_err < 0.6 and 0 <= peak_err < 0.6
    with pytest.raises(ValueError, match="unknown forecaster"):
        forecasts(profile, w, trace, 5.0, 300.0, 0, SAMPLE, 900.0, "oracle")


def test_the_forecaster_arms_differ_and_a_forecast_never_reads_its_own_window(profile) -> None:
    w = WORKLOADS["conv-a0.5"]
    trace = build_trace(profile, w, 5.0, seed=0, azure_dir=SAMPLE, duration_s=1200.0)
    ens, csp = (forecasts(profile, w, trace, 5.0, 300.0, 0, SAMPLE, 900.0, f) for f in ("ensemble", "csp"))
    assert [f.avg for f in ens.per_model["llama2-7b-0"]] != [f.avg for f in csp.per_model["llama2-7b-0"]]
    # the last 5 minutes of the replay dropped: every earlier window's forecast stays the same (causal)
    cut = type(trace)(header=trace.header, records=[r for r in trace.records if r.arrival_s < 900.0])
    early = forecasts(profile, w, cut, 5.0, 300.0, 0, SAMPLE, 900.0, "ensemble")
    for model, series in ens.per_model.items():
        assert [f.avg for f in early.per_model[model][:3]] == pytest.approx([f.avg for f in series[:3]])


def test_the_systems_differ_only_in_prewarming_and_the_engine_pool() -> None:
    s = systems()
    assert [(x.prewarm, x.engine_pool, x.keep_weights, x.autoscale) for x in s.values()] == [
        ("proactive", True, True, True), ("reactive", True, True, True), ("none", False, True, True),
        ("none", True, True, True)]
    assert len({x.scaler for x in s.values()}) == 1


def test_a_missing_trace_directory_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="AzureLLMInferenceTrace_code.csv"):
        load_hour("code", str(tmp_path))

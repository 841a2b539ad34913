"""WarmServe §7.1's setting from the real Azure LLM 2023 hours (loadgen/repro/warmserve_setup.py): the public
code's sampling (power-law counts, repeated rows drawn without replacement, the 1,024-token input cap), the
per-model shift, the window loads CSP is fed, and the forecasts. Fixture: tests/repro/data/azure-llm-2023-sample/
(every tenth request of the real hours; CC-BY 4.0, Patel et al., Splitwise, ISCA 2024)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadgen.repro.warmserve_setup import (
    INPUT_CAP, WORKLOADS, build_trace, forecasts, load_hour, sample_requests, systems, window_loads,
)
from loadgen.sim.fleet_profile import load_fleet_profile
from loadgen.traces.azure import power_law_shares

SAMPLE = str(Path(__file__).with_name("data") / "azure-llm-2023-sample")


@pytest.fixture(scope="module")
def profile():
    return load_fleet_profile("warmserve-h800-llama2")


def test_each_model_gets_its_power_law_share_of_rps_x_the_hour(profile) -> None:
    trace = build_trace(profile, WORKLOADS["conv-a2.0"], 10.0, seed=0, azure_dir=SAMPLE)
    counts = {m.name: sum(1 for r in trace.records if r.model == m.name) for m in profile.models}
    shares = power_law_shares(4, 2.0)
    assert round(float(shares[0]), 3) == 0.702  # §7.3: 7B-0 gets 70.2% at alpha 2
    assert counts == {m.name: int(10.0 * 3600 * float(s)) for m, s in zip(profile.models, shares)}
    assert trace.header.duration_s == 3600.0
    assert all(0 <= r.arrival_s < 3600 for r in trace.records)
    assert all(r.prompt_tokens <= INPUT_CAP and 3 <= r.output_tokens <= 1023 for r in trace.records)


def test_rows_are_repeated_then_drawn_without_replacement_and_shifted_per_model() -> None:
    hour = load_hour("code", SAMPLE)
    rng = np.random.default_rng(1)
    n = 3 * len(hour.times) + 5  # more requests than rows: every row 4 times, n of them drawn
    times, prompts, outputs = sample_requests(hour, n, 0.0, rng)
    assert len(times) == n and (np.diff(times) >= 0).all()
    drawn = np.unique(times, return_counts=True)[1]
    assert drawn.max() <= 4 * np.unique(hour.times, return_counts=True)[1].max()
    assert set(np.round(times, 6)) <= set(np.round(hour.times, 6))  # real arrival instants, uncompressed
    shifted, _, _ = sample_requests(hour, 100, 900.0, np.random.default_rng(2))
    assert set(np.round(shifted, 4)) <= set(np.round((hour.times + 900.0) % 3600.0, 4))


def test_window_loads_on_worked_numbers() -> None:
    # requests at 0 s (10 s long), 5 s (10 s) and 30 s (5 s); windows of 10 s over 40 s
    avg, peak = window_loads(np.array([0.0, 5.0, 30.0]), np.array([10.0, 10.0, 5.0]), 40.0, 10.0)
    assert avg == pytest.approx([1.5, 0.5, 0.0, 0.5])  # 0-5: 1, 5-10: 2 | 10-15: 1 | - | 30-35: 1
    assert peak == pytest.approx([2, 1, 0, 1])


def test_csp_forecasts_every_window_of_the_run_from_earlier_days(profile) -> None:
    w = WORKLOADS["conv-a0.5"]
    trace = build_trace(profile, w, 5.0, seed=0, azure_dir=SAMPLE)
    fc = forecasts(profile, w, trace, 5.0, 300.0, 2, 0, SAMPLE)
    assert set(fc.per_model) == {m.name for m in profile.models}
    assert all(len(series) == 12 for series in fc.per_model.values())
    assert all(f.peak >= f.avg >= 0 for series in fc.per_model.values() for f in series)
    avg_err, peak_err = fc.error()
    assert 0 <= avg_err < 0.5 and 0 <= peak_err < 0.5


def test_the_systems_differ_only_in_prewarming_and_the_engine_pool() -> None:
    s = systems()
    assert [(x.prewarm, x.engine_pool, x.keep_weights, x.autoscale) for x in s.values()] == [
        ("proactive", True, True, True), ("reactive", True, True, True), ("none", False, True, True),
        ("none", True, True, True)]
    assert len({x.scaler for x in s.values()}) == 1


def test_a_missing_trace_directory_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="AzureLLMInferenceTrace_code.csv"):
        load_hour("code", str(tmp_path))

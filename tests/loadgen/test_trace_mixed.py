"""`tidal trace mixed` (loadgen/traces/mixed.py) and the replay of the real Azure LLM 2023 CSVs."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadgen.traces.generate import generate
from loadgen.traces.io import read_trace
from loadgen.traces.loaders import load_azure_csv
from loadgen.traces.mixed import place_model_bursts
from loadgen.traces.schema import MixedParams, ModelBurst
from tidal.cli import main

AZURE_EXCERPT = Path(__file__).resolve().parents[1] / "data" / "azure-llm-2023"
MODELS = [f"m{i}" for i in range(6)]


def mixed(**kw) -> MixedParams:
    base = dict(seed=3, duration_s=1800.0, rate=20.0, models=MODELS, period_s=1800.0, adapter_models=["m1", "m4"],
                adapters_per_model=50)
    return MixedParams(**{**base, **kw})  # type: ignore[arg-type]


def test_popularity_follows_the_power_law_and_runs_are_reproducible():
    trace = generate(mixed(alpha=1.0, daily_amplitude=0.0, cv=1.0))
    counts = Counter(r.model for r in trace.records)
    shares = np.array([counts[m] for m in MODELS]) / len(trace.records)
    expected = np.arange(1, 7) ** -1.0 / np.sum(np.arange(1, 7) ** -1.0)
    assert np.allclose(shares, expected, atol=0.015)
    again = generate(mixed(alpha=1.0, daily_amplitude=0.0, cv=1.0))
    assert again.records[:50] == trace.records[:50] and len(again.records) == len(trace.records)


def test_adapters_only_on_their_models_with_zipf_popularity():
    trace = generate(mixed(adapter_fraction=0.9, zipf_s=1.2))
    with_adapter = [r for r in trace.records if r.adapter]
    assert {r.model for r in with_adapter} == {"m1", "m4"}
    assert all(r.adapter.startswith(r.model + "-lora-") for r in with_adapter)  # type: ignore[union-attr]
    m1 = [r for r in trace.records if r.model == "m1"]
    assert sum(r.adapter is not None for r in m1) / len(m1) == pytest.approx(0.9, abs=0.03)
    ranked = [n for _, n in Counter(r.adapter for r in with_adapter if r.model == "m1").most_common()]
    assert ranked[0] > 5 * ranked[min(19, len(ranked) - 1)]  # the head dwarfs the 20th
    assert len(trace.header.adapters) == 100 and {a.model for a in trace.header.adapters} == {"m1", "m4"}


def test_diurnal_drift_moves_which_model_is_hot():
    trace = generate(mixed(alpha=0.0, daily_amplitude=0.9, phase_spread=0.5, bursts=[]))
    halves = [Counter(r.model for r in trace.records if (r.arrival_s < 900) == first) for first in (True, False)]
    ratio = {m: halves[0][m] / max(halves[1][m], 1) for m in MODELS}
    assert max(ratio.values()) > 2 and min(ratio.values()) < 0.5  # some models peak early, others late


def test_a_burst_multiplies_its_models_rate_and_long_requests_are_longer():
    burst = ModelBurst(model="m5", start_s=600.0, duration_s=120.0, magnitude=10.0)
    trace = generate(mixed(daily_amplitude=0.0, bursts=[burst], long_fraction=0.2))
    m5 = np.array([r.arrival_s for r in trace.records if r.model == "m5"])
    inside = np.sum((m5 >= 602) & (m5 < 718)) / 116
    outside = np.sum(m5 < 590) / 590
    assert inside > 6 * outside
    prompts = np.array([r.prompt_tokens for r in trace.records])
    assert np.mean(prompts > 4096) == pytest.approx(0.2 * np.mean(prompts > 512), abs=0.05)


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match=r"adapter or burst model\(s\) \['zz'\]"):
        generate(mixed(adapter_models=["zz"]))
    with pytest.raises(ValueError, match="long_fraction must be in"):
        generate(mixed(long_fraction=1.5))
    placed = place_model_bursts(1, 3600.0, MODELS, 3, 60.0, 8.0)
    assert len(placed) == 3 and all(b.model in MODELS for b in placed)
    assert placed == place_model_bursts(1, 3600.0, MODELS, 3, 60.0, 8.0)


def test_cli_mixed_writes_a_trace(tmp_path, capsys):
    out = tmp_path / "mixed.jsonl"
    assert main(["trace", "mixed", "--duration", "10m", "--models", "5", "--adapter-models", "2", "--seed", "4",
                 "--out", str(out)]) == 0
    trace = read_trace(out)
    assert isinstance(trace.header.params, MixedParams) and len(trace.header.params.adapter_models) == 2
    assert len(trace.header.params.bursts) == 3 and trace.models() == [f"model-{i}" for i in range(5)]
    assert main(["trace", "mixed", "--models", "3", "--adapter-models", "4", "--out", str(tmp_path / "x")]) == 2
    assert "--adapter-models 4: there are 3 models" in capsys.readouterr().err


def test_cli_replays_the_real_azure_csv_as_recorded(tmp_path):
    src = AZURE_EXCERPT / "AzureLLMInferenceTrace_code.csv"
    out = tmp_path / "code.jsonl"
    assert main(["trace", "azure", "--csv", str(src), "--model", "code", "--out", str(out)]) == 0
    trace = read_trace(out)
    rows = src.read_text().splitlines()[1:]
    assert len(trace.records) == len(rows) == 781
    # the second row: 0.052 s after the first, 3180 prompt and 8 generated tokens, as the CSV has them
    assert rows[1] == "2023-11-16 18:17:04.0319600,3180,8"
    second = trace.records[1]
    assert (second.prompt_tokens, second.output_tokens) == (3180, 8)
    assert second.arrival_s == pytest.approx(0.052, abs=1e-6)
    window = load_azure_csv(src, start_s=200.0, duration_s=30.0)  # a window of it, shifted to start at 0
    assert window.records and all(0.0 <= r.arrival_s < 30.0 for r in window.records)
    assert len(window.records) == sum(1 for r in trace.records if 200.0 <= r.arrival_s < 230.0)

"""The economy repro's phased trace (loadgen/repro/economy_phased.py): Azure 2023 rows in three phases whose
load, adapters and lengths differ as designed, per-phase figures, and clear errors on bad input."""
from __future__ import annotations

import numpy as np
import pytest

from loadgen.repro.economy_phased import AZURE_DIR, PHASES, azure_rows, phase_of, phased_trace
from loadgen.repro.economy_phases import phase_metrics
from loadgen.sim.economy_result import EconomyResult

MODELS = ["llama2-7b-0", "llama2-7b-1", "llama2-13b", "llama2-70b"]
ADAPTED = MODELS[:2]

pytestmark = pytest.mark.skipif(not (AZURE_DIR / "AzureLLMInferenceTrace_conv.csv").exists(),
                                reason="the Azure 2023 trace is not in ../shared/data")


def _trace(seed: int = 0):
    return phased_trace(MODELS, ADAPTED, 20.0, seed, 300.0, adapters_per_model=200)


def test_each_phase_has_its_designed_mix_of_models_and_adapters():
    tr = _trace()
    t = np.array([r.arrival_s for r in tr.records])
    ph = phase_of(t, 300.0, 3)
    assert tr.header.duration_s == 900.0 and t.max() < 900.0
    for k, phase in enumerate(PHASES):
        recs = [r for r, p in zip(tr.records, ph) if p == k]
        rate = len(recs) / 300.0
        assert rate == pytest.approx(20.0 * phase.load, rel=0.25), phase.name  # the CSV's own burstiness
        share = np.array([sum(r.model == m for r in recs) for m in MODELS]) / len(recs)
        assert np.argmax(share) == int(np.argmax(phase.shares)), phase.name
        on_adapted = [r for r in recs if r.model in ADAPTED]
        named = sum(r.adapter is not None for r in on_adapted) / len(on_adapted)
        assert named == pytest.approx(phase.adapter_fraction, abs=0.05), phase.name
    # lora-heavy: flat popularity -> many more distinct adapters than in the popularity shift
    distinct = [len({r.adapter for r, p in zip(tr.records, ph) if p == k and r.adapter}) for k in (0, 2)]
    assert distinct[0] > 1.5 * distinct[1]


def test_the_burst_is_of_the_services_long_generations_and_lengths_are_real_rows():
    tr = _trace()
    ph = phase_of(np.array([r.arrival_s for r in tr.records]), 300.0, 3)
    _, prompts, outputs = azure_rows("conv")
    q75 = np.quantile(outputs, 0.75)
    burst = [r for r, p in zip(tr.records, ph) if p == 1 and r.model == "llama2-13b"]
    assert burst and min(r.output_tokens for r in burst) >= min(q75, 4096 - max(r.prompt_tokens for r in burst))
    rows = set(zip(prompts.tolist(), outputs.tolist()))
    plain = [r for r, p in zip(tr.records, ph) if p == 0 and r.model == "llama2-7b-0" and r.prompt_tokens < 3000]
    assert all((r.prompt_tokens, r.output_tokens) in rows for r in plain[:200])
    assert all(r.prompt_tokens + r.output_tokens <= 4096 for r in tr.records)


def test_seeds_give_different_slices_and_the_same_seed_the_same_trace():
    a, b, c = _trace(0), _trace(0), _trace(1)
    assert [(r.arrival_s, r.prompt_tokens) for r in a.records] == [(r.arrival_s, r.prompt_tokens) for r in b.records]
    assert [r.prompt_tokens for r in a.records[:50]] != [r.prompt_tokens for r in c.records[:50]]
    assert "azure-llm-2023" in a.header.params.source


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="rate and phase_s"):
        phased_trace(MODELS, ADAPTED, 0.0, 0, 300.0)
    with pytest.raises(ValueError, match="shares"):
        phased_trace(MODELS[:3], ADAPTED, 10.0, 0, 300.0)
    with pytest.raises(ValueError, match="not among the models"):
        phased_trace(MODELS, ["other"], 10.0, 0, 300.0)


def test_phase_metrics_count_each_phases_tail_preemptions_and_queueing():
    n = 300
    arrival = np.arange(n) * 3.0  # 100 requests per 300 s phase
    ttft = np.full(n, 0.2)
    ttft[150:152] = 9.0  # the tail is in the second phase
    pre = np.zeros(n, np.int64)
    pre[160] = 2
    r = EconomyResult("arbiter", 1, ["m"], np.zeros(n, np.int64), ttft, np.full(n, 0.01), np.full(n, 0.1),
                      arrival=arrival, preempted=pre)
    got = phase_metrics(r, ["a", "b", "c"], 300.0, 5.0, 0.0)
    assert [g.requests for g in got] == [100, 100, 100]
    assert got[0].p99_ttft == pytest.approx(0.2) and got[1].p99_ttft > 8.0
    assert [g.preemptions for g in got] == [0, 2, 0]
    assert got[1].slo == pytest.approx(0.98) and got[1].queueing_s == pytest.approx(0.1 + 2 * 8.8 / 100)
    with pytest.raises(ValueError, match="arrival"):
        phase_metrics(EconomyResult("x", 1, ["m"], np.zeros(2, np.int64), np.zeros(2), np.zeros(2), np.zeros(2)),
                      ["a"], 300.0, 5.0, 0.0)

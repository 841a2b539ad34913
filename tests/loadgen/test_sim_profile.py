"""Profile files: the shipped defaults, round trips, validation, cost arithmetic."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.sim.profile import CostProfile, StepCost, builtin_profiles, load_profile, save_profile
from loadgen.sim.run import simulate
from loadgen.traces.schema import PoissonParams, Trace, TraceHeader, TraceRecord


def test_shipped_cpu_profile_is_the_default() -> None:
    assert load_profile("cpu") == CostProfile() == load_profile(None)
    assert {"cpu", "a100-7b"} <= set(builtin_profiles())
    gpu = load_profile("a100-7b")
    assert gpu.worker.kv_blocks == 7500 and gpu.link("nvlink").bandwidth_bytes_per_s == 2e11


def test_json_round_trip_and_toml_file(tmp_path: Path) -> None:
    prof = CostProfile(name="mine", step=StepCost(overhead_s=0.5), models={"big": StepCost(overhead_s=2.0)})
    assert load_profile(save_profile(tmp_path / "p.json", prof)) == prof
    toml = tmp_path / "p.toml"
    toml.write_text('name = "t"\n[step]\noverhead_s = 0.1\n[worker]\nkv_blocks = 64\n[models.big]\noverhead_s = 0.3\n')
    got = load_profile(toml)
    assert (got.name, got.step.overhead_s, got.worker.kv_blocks) == ("t", 0.1, 64)
    assert got.step_cost("big").overhead_s == 0.3 and got.step_cost("other").overhead_s == 0.1


def test_bad_profiles_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[step]\noverhed_s = 0.1\n")
    with pytest.raises(ValueError, match="overhed_s"):
        load_profile(bad)
    bad.write_text("[worker]\nmax_batch = 64\nmax_batched_tokens = 32\n")
    with pytest.raises(ValueError, match="max_batched_tokens >= max_batch"):
        load_profile(bad)
    bad.write_text("[step]\noverhead_s = -1.0\n")
    with pytest.raises(ValueError, match="non-negative"):
        load_profile(bad)
    with pytest.raises(ValueError, match="cannot read.*built-ins: a10-llama2-7b-lora, a100-40g-llama2-13b, a100-7b, a800-qwen2.5-14b, cpu, rtx4090-llama2-7b"):
        load_profile("h100-nonexistent")


def test_cost_arithmetic() -> None:
    step = StepCost(overhead_s=0.01, decode_per_seq_s=0.002, decode_per_ctx_token_s=1e-6, prefill_per_token_s=1e-4,
                    prefill_attn_s=1e-9)
    assert step.step_s(4, 1000) == pytest.approx(0.01 + 0.008 + 0.001)
    assert step.step_s(0, 0, 500, 500 * 500) == pytest.approx(0.01 + 0.05 + 0.00025)
    prof = CostProfile()
    assert prof.transfer_s(1_250_000_000, "tcp") == pytest.approx(1.0001)
    with pytest.raises(KeyError, match="no link 'rdma'"):
        prof.link("rdma")


def test_per_model_step_cost_reaches_the_simulator() -> None:
    recs = [TraceRecord(arrival_s=0.0, model=m, prompt_tokens=10, output_tokens=1, request_id=m) for m in ("a", "b")]
    trace = Trace(header=TraceHeader(params=PoissonParams(), num_records=2, duration_s=1.0), records=recs)
    prof = CostProfile(request_overhead_s=0.0, models={"b": StepCost(overhead_s=1.0)})
    ttft = {r.model: r.first_token_s - r.arrival_s for r in simulate(trace, prof, workers=2).records}
    assert ttft["a"] == pytest.approx(prof.step.step_s(0, 0, 10, 100))
    assert ttft["b"] == pytest.approx(StepCost(overhead_s=1.0).step_s(0, 0, 10, 100))

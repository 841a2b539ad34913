"""`tidal profile` on a tiny checkpoint writes a profile the simulator loads and runs; the
fit recovers known coefficients; calibration adds the live path's measured gaps."""
from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.profiler.fit import fit_error, fit_step_cost
from loadgen.profiler.measure import StepSample
from loadgen.sim.profile import StepCost, load_profile
from loadgen.sim.run import simulate
from loadgen.traces.generate import generate
from loadgen.traces.schema import PoissonParams


def test_fit_recovers_known_coefficients() -> None:
    truth = StepCost(overhead_s=0.002, decode_per_seq_s=1e-4, decode_per_ctx_token_s=2e-7,
                     prefill_per_token_s=5e-5, prefill_attn_s=1e-8)
    samples = [StepSample(b, b * c, 0, 0, truth.step_s(b, b * c)) for b in (1, 2, 4, 8, 16) for c in (32, 256)]
    samples += [StepSample(0, 0, p, p * p, truth.step_s(0, 0, p, p * p)) for p in (8, 64, 128, 512)]
    fitted = fit_step_cost(samples)
    for name in StepCost.__struct_fields__:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fit_error(fitted, samples)[1] < 1e-6


def test_fit_keeps_coefficients_non_negative() -> None:
    # decode time falling with context would need a negative coefficient: it is dropped instead
    samples = [StepSample(1, 10, 0, 0, 0.010), StepSample(1, 1000, 0, 0, 0.009), StepSample(4, 40, 0, 0, 0.012),
               StepSample(0, 0, 64, 4096, 0.02)]
    fitted = fit_step_cost(samples)
    assert min(fitted.overhead_s, fitted.decode_per_seq_s, fitted.decode_per_ctx_token_s,
               fitted.prefill_per_token_s, fitted.prefill_attn_s) >= 0
    assert fitted.decode_per_ctx_token_s == 0


def test_profile_command_writes_a_profile_the_simulator_runs(tmp_path: Path) -> None:
    from services.gpu_worker.engine.checkpoint_gen import make_model
    from tidal.cli import main

    model = make_model(tmp_path / "m", arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,
                       max_position=512, seed=1)
    out = tmp_path / "prof.json"
    code = main(["profile", str(model), "--out", str(out), "--batches", "1,4", "--contexts", "16,64",
                 "--steps", "3", "--prefill", "8,64,128", "--repeats", "1", "--max-batch", "8"])
    assert code == 0
    profile = load_profile(out)
    assert profile.name == "m" and profile.worker.max_model_len == 512 and profile.worker.max_batch == 8
    assert profile.worker.kv_bytes_per_token == 2 * 2 * 16 * 4 * 2  # K+V x kv_heads x head_dim x fp32 x layers
    assert profile.step.step_s(1, 16) > 0 and {l.name for l in profile.links} == {"tcp", "shm", "disk"}  # disk: defaults
    assert profile.instance_start_s > 0 and profile.start_s() == profile.instance_start_s  # measured, used by scale-out
    trace = generate(PoissonParams(seed=0, duration_s=5, rate=4, model="m", prompt_tokens=32, output_tokens=8))
    result = simulate(trace, profile, workers=1)
    assert len(result.records) == len(trace.records) and all(r.status == "ok" for r in result.records)


def test_profile_command_rejects_a_directory_without_a_checkpoint(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from tidal.cli import main

    assert main(["profile", str(tmp_path), "--out", str(tmp_path / "p.json")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_calibration_makes_the_unloaded_simulation_match_the_live_numbers() -> None:
    from loadgen.profiler.calibrate import calibrate
    from loadgen.report.metrics import LatencyStats, ReportSummary
    from loadgen.sim.profile import CostProfile
    from loadgen.sim.run import unloaded_baseline

    def summary(ttft: float, tpot: float) -> ReportSummary:
        def stats(v: float) -> LatencyStats:
            return LatencyStats(count=10, mean=v, p50=v, p90=v, p99=v, max=v)
        return ReportSummary(requests=10, completed=10, statuses={"ok": 10}, duration_s=1.0, request_throughput=1.0,
                             output_token_throughput=1.0, total_token_throughput=1.0, ttft=stats(ttft),
                             tpot=stats(tpot), e2e=stats(ttft + 31 * tpot))

    profile = CostProfile()
    trace = generate(PoissonParams(seed=0, duration_s=10, rate=2, model="m", prompt_tokens=128, output_tokens=32))
    before = unloaded_baseline(trace, profile, sample=20)
    assert before.ttft is not None and before.tpot is not None
    live = summary(before.ttft.p50 + 0.015, before.tpot.p50 + 0.004)
    tuned, lines = calibrate(profile, trace, live)
    after = unloaded_baseline(trace, tuned, sample=20)
    assert after.tpot is not None and after.ttft is not None
    assert after.tpot.p50 == pytest.approx(live.tpot.p50, rel=1e-6)  # type: ignore[union-attr]
    assert after.ttft.p50 == pytest.approx(live.ttft.p50, rel=1e-6)  # type: ignore[union-attr]
    assert tuned.step.overhead_s == pytest.approx(profile.step.overhead_s + 0.004)
    assert "calibrated" in lines[-1]

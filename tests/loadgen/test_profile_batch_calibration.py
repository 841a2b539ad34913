"""The profiler's shared-host helpers on small inputs: the fastest pass per point, and the live
path's per-sequence step cost from requests sent k at a time."""
from __future__ import annotations

import pytest

from loadgen.profiler.calibrate import calibrate_batch, simulated_groups
from loadgen.profiler.measure import StepSample
from loadgen.profiler.profile_engine import fastest, kv_token_blocks
from loadgen.report.metrics import summarize_records
from loadgen.report.records import RequestRecord
from loadgen.sim.profile import CostProfile, StepCost, WorkerSpec
from loadgen.traces.generate import generate
from loadgen.traces.schema import PoissonParams

STEP = StepCost(overhead_s=0.004, decode_per_seq_s=0.0001, decode_per_ctx_token_s=0.0, prefill_per_token_s=0.0001,
                prefill_attn_s=0.0)


def test_fastest_keeps_each_points_quickest_pass() -> None:
    a = [StepSample(1, 32, 0, 0, 0.004), StepSample(0, 0, 64, 4096, 0.010)]
    b = [StepSample(1, 32, 0, 0, 0.003), StepSample(0, 0, 64, 4096, 0.012)]
    got = sorted(fastest([a, b]), key=lambda s: s.prefill_tokens)
    assert [s.seconds for s in got] == [0.003, 0.010]


def test_kv_blocks_are_counted_in_blocks_of_every_layer() -> None:
    assert kv_token_blocks(256, 4) == 64 and kv_token_blocks(258, 4) == 64  # the remainder is never usable
    with pytest.raises(ValueError):
        kv_token_blocks(10, 0)


def live_groups(tpot_s: float, n: int, output: int = 17) -> object:
    records = [RequestRecord(request_id=f"r{i}", model="m", arrival_s=0.0, prompt_tokens=32, output_tokens=output,
                             status="ok", first_token_s=0.01, finish_s=0.01 + (output - 1) * tpot_s) for i in range(n)]
    return summarize_records(records)


def test_the_per_sequence_gap_goes_to_decode_per_seq() -> None:
    profile = CostProfile(request_overhead_s=0.0, step=STEP, worker=WorkerSpec(max_batch=8, max_batched_tokens=512))
    trace = generate(PoissonParams(duration_s=20, rate=2, model="m", prompt_tokens=32, output_tokens=17))
    sim = simulated_groups(trace, profile, 8, 4)
    # 4 decoding together, one step per token (the first arrival starts alone: one step of fewer)
    assert sim.tpot.p50 == pytest.approx(0.004 + 4 * 0.0001, rel=0.01)
    # live decodes 4 together at 5.6 ms a token: 1.2 ms more, over 3 extra sequences = 0.4 ms each
    tuned, lines = calibrate_batch(profile, trace, live_groups(0.0056, 8), 8, 4)
    gap = (0.0056 - sim.tpot.p50) / 3
    assert tuned.step.decode_per_seq_s == pytest.approx(0.0001 + gap) and gap == pytest.approx(0.0004, rel=0.02)
    assert tuned.step.overhead_s == pytest.approx(0.004 - gap)  # one sequence's step stays as it was
    assert simulated_groups(trace, tuned, 8, 4).tpot.p50 == pytest.approx(0.0056, rel=0.01)
    assert simulated_groups(trace, tuned, 8, 1).tpot.p50 == pytest.approx(simulated_groups(trace, profile, 8, 1).tpot.p50)
    assert f"per-sequence step cost +{gap * 1000:.3f} ms" in lines[0]
    # a live path faster than the profile adds nothing (never below the engine's own cost)
    same, _ = calibrate_batch(profile, trace, live_groups(0.003, 8), 8, 4)
    assert same.step == profile.step
    with pytest.raises(ValueError, match="at least 2"):
        calibrate_batch(profile, trace, live_groups(0.003, 8), 8, 1)

"""`tidal sim --scale-out`: one instance per model from the start, one more on measured saturation,
serving only from the decision plus the instance start (loadgen/sim/scale_out.py)."""
from __future__ import annotations

import pytest

from loadgen.sim.profile import CostProfile, StepCost, WorkerSpec
from loadgen.sim.run import simulate
from loadgen.sim.scale_out import ScaleOutSpec, spec_from_config
from loadgen.traces.schema import PoissonParams, Trace, TraceHeader, TraceRecord
from shared.config import load_config
from shared.policy.saturation import SaturationParams

COST = StepCost(overhead_s=0.01, decode_per_seq_s=0.002, decode_per_ctx_token_s=1e-5, prefill_per_token_s=1e-3,
                prefill_attn_s=0.0)
PROFILE = CostProfile(request_overhead_s=0.0, instance_start_s=3.0, step=COST,
                      worker=WorkerSpec(max_batch=4, max_batched_tokens=512, kv_blocks=100_000))


def trace(n: int, gap_s: float, prompt: int = 200, output: int = 200) -> Trace:
    records = [TraceRecord(arrival_s=i * gap_s, model="m", prompt_tokens=prompt, output_tokens=output,
                           request_id=f"r{i}") for i in range(n)]
    return Trace(header=TraceHeader(params=PoissonParams(), num_records=n, duration_s=n * gap_s), records=records)


SPEC = ScaleOutSpec(initial=1, interval_s=1.0, start_s=PROFILE.start_s(), stats_lag_s=1.0,
                    saturation=SaturationParams(window_s=5.0, tpot_factor=5.0))


def test_a_queue_that_does_not_drain_starts_the_standby_worker_which_serves_only_after_its_start() -> None:
    # a batch cap of 4 and 2 arrivals a second of ~2.4 s requests: requests wait on w0
    result = simulate(trace(40, 0.5), PROFILE, workers=2, scale_out=SPEC)
    (event,) = result.scale_outs
    assert event.worker == "w1" and "waiting" in event.reason
    assert event.serving_s == pytest.approx(event.decided_s + 3.0 + 1.0)
    on_w1 = [r for r in result.records if r.worker == "w1"]
    assert on_w1, "the started instance took no request"
    assert min(r.arrival_s for r in on_w1) >= event.serving_s  # nothing routed to it before it serves
    assert all(r.worker == "w0" for r in result.records if r.arrival_s < event.serving_s)


def test_a_burst_at_the_start_scales_out_within_the_first_window() -> None:
    # the cluster was idle before the trace (the monitor has watched it already): no settling window at 0
    burst = trace(12, 0.0)
    (event,) = simulate(burst, PROFILE, workers=2, scale_out=SPEC).scale_outs
    assert event.decided_s < SPEC.saturation.window_s


def test_a_scaled_out_run_is_slower_than_two_instances_from_the_start() -> None:
    t = trace(40, 0.5)
    scaled = simulate(t, PROFILE, workers=2, scale_out=SPEC).records
    both = simulate(t, PROFILE, workers=2).records
    assert max(r.first_token_s - r.arrival_s for r in scaled) > max(r.first_token_s - r.arrival_s for r in both)


def test_a_light_load_never_scales_out() -> None:
    result = simulate(trace(5, 4.0, output=20), PROFILE, workers=2, scale_out=SPEC)
    assert result.scale_outs == []
    assert {r.worker for r in result.records} == {"w0"}


def test_the_default_config_scales_out_on_saturation_with_a_floor_of_one() -> None:
    spec = spec_from_config(load_config(None), start_s=2.5)
    assert spec.initial == 1 and spec.start_s == 2.5 and spec.interval_s == 1.0
    assert spec.saturation.tpot_factor == 5.0  # [slo] tpot = "5x"


def test_an_unmeasured_start_is_the_weights_read_over_the_disk_link() -> None:
    p = CostProfile(worker=WorkerSpec(weights_bytes=2_000_000_000))
    assert p.start_s() == pytest.approx(p.transfer_s(2_000_000_000, "disk"))
    assert CostProfile(instance_start_s=7.0).start_s() == 7.0

"""The trace's offered load against the probed capacity (pure): the numbers a warning carries."""
from __future__ import annotations

from loadgen.runner.capacity import PROBE_STREAMS, ProbedCapacity, fit_notes, offered_load, probe_trace
from loadgen.traces.schema import TraceRecord


def records(times: list[float], output: int = 100, model: str = "m") -> list[TraceRecord]:
    return [TraceRecord(arrival_s=t, model=model, prompt_tokens=50, output_tokens=output) for t in times]


def capacity(tokens_per_s: float) -> ProbedCapacity:
    return ProbedCapacity(model="m", streams=8, output_tokens=int(tokens_per_s * 4), wall_s=4.0, failed=0)


def test_offered_load_has_the_mean_and_the_busiest_window() -> None:
    calm = [float(t) for t in range(0, 100, 2)]  # 50 requests over 98 s
    burst = [50.0 + i * 0.1 for i in range(50)]  # 50 more within 5 s
    load = offered_load(records(sorted(calm + burst)))
    assert load.requests == 100 and load.span_s == 98.0 and load.output_tokens == 10_000
    assert abs(load.output_rate - 10_000 / 98) < 1e-9
    assert load.peak_output_rate >= 5_000 / 30  # the burst's 50 x 100 tokens fall within one 30 s window
    few = offered_load(records([0.0, 0.1, 50.0], output=1000))  # two requests close together are no burst
    assert few.peak_output_rate == few.output_rate


def test_an_overload_names_the_factor_and_a_time_scale_that_fits() -> None:
    load = offered_load(records([i * 0.1 for i in range(100)]))  # ~101 tokens/s x 10
    (note,) = fit_notes(load, capacity(100.0))
    assert "offers 1010 output tokens/s on average (100 requests, 10000 output tokens over 10 s)" in note
    assert "10.1x what a probe of 8 streams x 32 tokens to m generated 100 output tokens/s" in note
    assert "--time-scale 0.079" in note and "429" in note


def test_bursts_above_capacity_and_a_fitting_trace() -> None:
    calm = [float(t) for t in range(0, 200, 4)]
    burst = [100.0 + i * 0.05 for i in range(40)]
    load = offered_load(records(sorted(calm + burst)))
    (note,) = fit_notes(load, capacity(100.0))
    assert "busiest 30 s" in note and "queueing during bursts" in note
    assert fit_notes(offered_load(records(calm)), capacity(100.0)) == []
    assert "got no tokens" in fit_notes(load, ProbedCapacity("m", 8, 0, 1.0, failed=8))[0]


def test_the_probe_asks_the_commonest_model_with_a_median_prompt() -> None:
    trace = records([0.0, 1.0], model="a") + records([2.0, 3.0, 4.0], model="b")
    probe = probe_trace(trace)
    assert len(probe) == PROBE_STREAMS and {(r.model, r.prompt_tokens, r.arrival_s) for r in probe} == {("b", 50, 0.0)}

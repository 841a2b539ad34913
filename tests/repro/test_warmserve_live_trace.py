"""The trace of `tidal repro warmserve --live` (pure): seeded, and its hot pair of models moves each phase."""
from __future__ import annotations

from collections import Counter

from loadgen.repro.warmserve_live import WarmLiveConfig, WarmLiveRun, RunResult, shifting_trace

MODELS = ["a", "b", "c", "d", "e"]


def test_the_hot_pair_shifts_every_phase_and_the_seed_fixes_the_trace() -> None:
    cfg = WarmLiveConfig(duration_s=400.0, phases=4, hot_rps=1.0, cold_rps=0.02)
    trace = shifting_trace(cfg, MODELS)
    assert trace == shifting_trace(cfg, MODELS) and trace != shifting_trace(WarmLiveConfig(seed=1), MODELS)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert len({r.request_id for r in trace}) == len(trace)
    for p in range(4):
        counts = Counter(r.model for r in trace if p * 100 <= r.arrival_s < (p + 1) * 100)
        top = {m for m, _ in counts.most_common(2)}
        assert top == {MODELS[p], MODELS[p + 1]}, (p, counts)
    assert all(16 <= r.prompt_tokens < 64 and 8 <= r.output_tokens < 16 for r in trace)


def test_the_summary_line_is_the_no_prewarm_p99_over_the_prewarm_p99() -> None:
    def result(prewarm: bool, p99: float, ups: int, warm: int) -> RunResult:
        return RunResult(prewarm=prewarm, ttft_p50_s=0.05, ttft_p99_s=p99, requests=10, lost=0, scale_ups=ups,
                         warm_scale_ups=warm, prewarms=1, scale_downs=1, wall_s=1.0)

    run = WarmLiveRun(WarmLiveConfig(), runs={"prewarm": result(True, 0.4, 10, 7),
                                              "no-prewarm": result(False, 1.0, 9, 0)})
    assert run.line() == "repro warmserve (live): live_p99_ttft_vs_no_prewarm=2.5x prewarm_hit=70%"


def test_the_probe_drives_one_model_and_its_line_says_when_it_scaled_out() -> None:
    from loadgen.repro.warmserve_live import ScaleOutProbe, probe_trace

    cfg = WarmLiveConfig(probe_rps=8.0, probe_s=15.0)
    trace = probe_trace(cfg, "a")
    assert trace == probe_trace(cfg, "a") and {r.model for r in trace} == {"a"}
    assert 80 <= len(trace) <= 160 and all(r.arrival_s < 15.0 for r in trace)
    probe = ScaleOutProbe(model="a", rps=8.0, batch=2, window_s=5.0, requests=120, lost=0, decided_s=3.4,
                          applied_s=4.1, worker="w2", worker_held="warm: c", scale_ups=3, refused=0)
    assert probe.line() == ("live autoscale: a at 8 rps (B=2, window 5 s): scale-out decided 3.4 s after the drive "
                            "began, applied at 4.1 s, onto w2 (warm: c); 3 scale-ups, 0 refused; 120/120 complete")
    run = WarmLiveRun(WarmLiveConfig(), runs={
        k: RunResult(prewarm=k == "prewarm", ttft_p50_s=0.05, ttft_p99_s=0.5, requests=10, lost=0, scale_ups=2,
                     warm_scale_ups=1, prewarms=1, scale_downs=1, wall_s=1.0) for k in ("prewarm", "no-prewarm")},
        probe=probe)
    assert run.line().endswith(" prewarm_hit=50% scale_out_s=3.4")

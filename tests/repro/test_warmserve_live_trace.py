"""The trace of `tidal repro warmserve --live` (pure): seeded, and its hot pair of models moves each phase."""
from __future__ import annotations

from collections import Counter

import pytest

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


def _result(prewarm: bool, p99: float, ups: int, warm: int) -> RunResult:
    return RunResult(prewarm=prewarm, ttft_p50_s=0.05, ttft_p99_s=p99, requests=10, lost=0, scale_ups=ups,
                     warm_scale_ups=warm, prewarms=1, scale_downs=1, wall_s=1.0)


def test_the_summary_line_is_the_no_prewarm_p99_over_the_prewarm_p99_median_and_range_over_runs() -> None:
    one = WarmLiveRun(WarmLiveConfig(), pairs=[{"prewarm": _result(True, 0.4, 10, 7),
                                                "no-prewarm": _result(False, 1.0, 9, 0)}])
    assert one.line() == "repro warmserve (live): live_p99_ttft_vs_no_prewarm=2.5x(2.5–2.5) runs=1 prewarm_hit=70%"
    three = WarmLiveRun(WarmLiveConfig(), pairs=[
        {"prewarm": _result(True, 0.4, 10, 7), "no-prewarm": _result(False, 1.0, 9, 0)},   # 2.5x
        {"no-prewarm": _result(False, 0.6, 9, 0), "prewarm": _result(True, 1.2, 10, 3)},   # 0.5x
        {"prewarm": _result(True, 1.0, 20, 10), "no-prewarm": _result(False, 1.1, 9, 0)},  # 1.1x
        {"prewarm": _result(True, 1.0, 20, 10)},  # an unfinished pair: no ratio, its starts still count
    ])
    assert three.ratios() == pytest.approx([2.5, 0.5, 1.1])
    # hit rate pooled over the prewarm runs: (7 + 3 + 10 + 10) / (10 + 10 + 20 + 20)
    assert three.line() == "repro warmserve (live): live_p99_ttft_vs_no_prewarm=1.1x(0.5–2.5) runs=3 prewarm_hit=50%"
    assert WarmLiveRun(WarmLiveConfig()).line().startswith("repro warmserve (live): live_p99_ttft_vs_no_prewarm=n/a runs=0")


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
    run = WarmLiveRun(WarmLiveConfig(), pairs=[{
        k: RunResult(prewarm=k == "prewarm", ttft_p50_s=0.05, ttft_p99_s=0.5, requests=10, lost=0, scale_ups=2,
                     warm_scale_ups=1, prewarms=1, scale_downs=1, wall_s=1.0) for k in ("prewarm", "no-prewarm")}],
        probe=probe)
    assert run.line().endswith(" prewarm_hit=50% scale_out_s=3.4")


def test_a_request_timeline_names_the_starts_and_prewarms_that_touched_its_wait() -> None:
    from types import SimpleNamespace

    from loadgen.report.records import RequestRecord
    from loadgen.repro.warmserve_live_timeline import Action, LiveWatch, describe, slowest, timeline

    t0 = 1000.0
    watch = LiveWatch()
    watch.served_by = {"resp-1-0": "w3", "resp-2-0": "w1"}
    watch.actions = {
        "p1": Action("scale_up", "e", "w3", t0 + 1.0, warm_bytes=5, load=2, serving=["d"], applied_unix=t0 + 1.1),
        "p2": Action("prewarm", "c", "w3", t0 + 1.5, applied_unix=t0 + 2.5),  # on w3 while request 1 waited
        "p3": Action("scale_up", "e", "w1", t0 + 9.0, applied_unix=t0 + 9.5),  # after both first tokens
        "p4": Action("scale_down", "d", "w1", t0 + 0.2, applied_unix=t0 + 0.3),  # done before either arrived
    }
    results = [SimpleNamespace(record=RequestRecord(request_id="r1", model="e", arrival_s=0.9, prompt_tokens=4,
                                                    output_tokens=4, first_token_s=4.0), response_id="resp-1"),
               SimpleNamespace(record=RequestRecord(request_id="r2", model="a", arrival_s=2.0, prompt_tokens=4,
                                                    output_tokens=4, first_token_s=2.1), response_id="resp-2")]
    lines, actions = timeline(watch, SimpleNamespace(results=results), t0)
    assert [a["decided_s"] for a in actions] == [0.2, 1.0, 1.5, 9.0]
    r1, r2 = lines
    assert r1.worker == "w3" and r1.ttft_s == pytest.approx(3.1)
    assert r1.events == ["scale_up e on w3 decided 1.00 applied 1.10 (warm 5 B, load 2, serving d)",
                         "prewarm c on w3 decided 1.50 applied 2.50 (warm 0 B, load 0, serving -)"]
    assert r2.worker == "w1" and r2.events == []
    assert slowest(lines, 1) == [r1]
    assert describe(r2) == "r2 a at 2.00 s: TTFT 0.10 s on w1; no start or prewarm touched it"

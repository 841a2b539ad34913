"""Report math against hand-computed values, and the files a report writes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadgen.report.metrics import SloSpec, summarize_records
from loadgen.report.plots import _memory_by_kind
from loadgen.report.records import MemorySample, PlanMarker, RequestRecord, read_records
from loadgen.report.write import read_summary, write_report

RECORDS = [
    RequestRecord(request_id="r1", model="a", arrival_s=0.0, first_token_s=0.5, finish_s=2.5,
                  prompt_tokens=10, output_tokens=5),
    RequestRecord(request_id="r2", model="a", arrival_s=1.0, first_token_s=1.2, finish_s=1.7,
                  prompt_tokens=20, output_tokens=6, token_times_s=[1.2, 1.3, 1.4, 1.5, 1.6, 1.7]),
    RequestRecord(request_id="r3", model="b", arrival_s=2.0, first_token_s=3.0, finish_s=3.0,
                  prompt_tokens=30, output_tokens=1),
    RequestRecord(request_id="r4", model="b", arrival_s=3.0, finish_s=3.1, prompt_tokens=40, output_tokens=0,
                  status="error", error="worker died"),
]


def test_percentiles_and_throughput_by_hand() -> None:
    s = summarize_records(RECORDS)
    assert (s.requests, s.completed, s.statuses) == (4, 3, {"error": 1, "ok": 3})
    # TTFT of the three successes: 0.5, 0.2, 1.0 -> P50 0.5; linear interpolation: P90 0.9, P99 0.99
    assert (s.ttft.p50, s.ttft.p90, s.ttft.p99) == pytest.approx((0.5, 0.9, 0.99))
    assert s.ttft.mean == pytest.approx(1.7 / 3) and s.ttft.max == 1.0
    # TPOT: r1 (2.5 - 0.5) / 4 = 0.5, r2 0.5 / 5 = 0.1; r3 has one token and no TPOT
    assert s.tpot.count == 2 and s.tpot.p50 == pytest.approx(0.3)
    assert (s.e2e.p50, s.e2e.max) == pytest.approx((1.0, 2.5))
    assert s.itl is not None and s.itl.count == 5 and s.itl.p50 == pytest.approx(0.1)
    # span: first arrival 0.0 to last finish 3.1
    assert s.duration_s == pytest.approx(3.1)
    assert s.request_throughput == pytest.approx(3 / 3.1)
    assert s.output_token_throughput == pytest.approx(12 / 3.1)
    assert s.total_token_throughput == pytest.approx((12 + 60) / 3.1)
    assert [(m.model, m.requests, m.completed) for m in s.models] == [("a", 2, 2), ("b", 2, 1)]


def test_slo_attainment_counts_failures_as_misses() -> None:
    s = summarize_records(RECORDS, slo=SloSpec(ttft_s=0.6, tpot_s=0.2))
    # r1 misses TPOT, r2 meets both, r3 misses TTFT (one token: no TPOT to miss), r4 failed
    assert s.slo.attainment == pytest.approx(0.25)
    assert s.slo.ttft_attainment == pytest.approx(0.5)
    assert s.slo.tpot_attainment == pytest.approx(0.5)
    assert s.slo.e2e_attainment is None
    assert [m.slo_attainment for m in s.models] == pytest.approx([0.5, 0.0])
    e2e = summarize_records(RECORDS, slo=SloSpec(e2e_s=1.0)).slo
    assert e2e.attainment == pytest.approx(0.5)  # r2 (0.7) and r3 (1.0)


def test_slo_scaled_from_a_baseline() -> None:
    unloaded = summarize_records([
        RequestRecord(request_id=str(i), model="a", arrival_s=float(i), first_token_s=i + 0.1, finish_s=i + 0.6,
                      prompt_tokens=5, output_tokens=11) for i in range(5)])
    slo = SloSpec.scaled(5.0, unloaded)
    assert slo.ttft_s == pytest.approx(0.5) and slo.tpot_s == pytest.approx(0.25)


def test_memory_overlay_sums_step_series_over_workers() -> None:
    samples = [MemorySample(t_s=0.0, worker="w0", kind="kv", bytes=100),
               MemorySample(t_s=2.0, worker="w0", kind="kv", bytes=300),
               MemorySample(t_s=1.0, worker="w1", kind="kv", bytes=50),
               MemorySample(t_s=0.0, worker="w1", kind="weights", bytes=1000)]
    got = _memory_by_kind(samples, np.array([0.0, 0.5, 1.0, 2.5]))
    np.testing.assert_allclose(got["kv"], [100, 100, 150, 350])
    np.testing.assert_allclose(got["weights"], [1000] * 4)


def test_write_report_files(tmp_path: Path) -> None:
    memory = [MemorySample(t_s=float(t), worker=f"w{w}", kind=k, bytes=(t + 1) * 2**28)
              for t in range(4) for w in range(2) for k in ("kv", "weights")]
    summary = write_report(tmp_path, RECORDS, slo=SloSpec(ttft_s=0.6), title="hand", memory=memory,
                           plans=[PlanMarker(t_s=1.5, label="drop layers")], extra={"workers": "2"})
    for name in ("records.jsonl", "summary.json", "report.md", "cdf.png", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert (tmp_path / "cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_records(tmp_path / "records.jsonl") == RECORDS
    assert read_summary(tmp_path / "summary.json") == summary
    md = (tmp_path / "report.md").read_text()
    assert "# hand" in md and "- workers: 2" in md
    assert "| TTFT | 500.0 | 900.0 | 990.0 | 566.7 | 1000.0 | 3 |" in md
    assert "attainment 50.0%" in md  # TTFT only: r1, r2 of four

"""`tidal bench predictor` end to end: Azure-like days, the real Azure 2023 excerpt, a user's plain CSV."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tidal.bench.predictor_series import busy_integral, concurrency_series
from tidal.bench.predictor_traces import read_arrivals, read_requests

ROOT = Path(__file__).resolve().parents[2]
AZURE_EXCERPT = ROOT / "tests" / "data" / "azure-llm-2023"
SUMMARY = re.compile(r"^bench predictor: ensemble_avg_err=\d+% ensemble_peak_err=\d+% best_member_avg_err=\d+% "
                     r"naive_avg_err=\d+% p90_coverage=\d+%$")


def test_plain_csv_of_timestamps_and_models(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("time,model\n100.0,a\n101.5,b\n160,a\n")
    per, span = read_arrivals(csv)
    assert span == 60.0 and np.allclose(per["a"], [0.0, 60.0]) and np.allclose(per["b"], [1.5])
    assert read_requests(csv)[0]["a"].prompt_tokens is None  # no lengths: a fixed request time
    bad = tmp_path / "bad.csv"
    bad.write_text("1.0\nnot-a-time\n")
    try:
        read_arrivals(bad)
    except SystemExit as exc:
        assert "bad.csv:2: bad timestamp" in str(exc)
    else:
        raise AssertionError("a bad timestamp was accepted")


def test_real_azure_excerpt_keeps_its_lengths():
    per, span = read_requests(AZURE_EXCERPT / "AzureLLMInferenceTrace_conv.csv")
    req = per["model-0"]
    assert len(req.arrivals) == 1445 and 299 < span < 300
    assert req.prompt_tokens[0] == 374 and req.output_tokens[0] == 44  # the first row as recorded
    assert np.all(np.diff(req.arrivals) >= 0)


def test_concurrency_is_the_time_mean_of_requests_in_the_system():
    starts, durations = np.array([0.0, 5.0, 12.0]), np.array([10.0, 10.0, 1.0])
    # in [0, 10): request 0 all 10 s, request 1 for 5 s -> 1.5; in [10, 20): request 1 5 s, request 2 1 s -> 0.6
    avg, peak = concurrency_series(starts, durations, 10.0, 5.0, 2)
    assert np.allclose(avg, [1.5, 0.6]) and np.allclose(peak, [2.0, 1.2])  # [10, 15): 1 + 1/5
    assert np.allclose(busy_integral(starts, starts + durations, np.array([0.0, 21.0])), [0.0, 21.0])


def test_bench_scores_members_and_ensemble_on_every_trace(tmp_path):
    rng = np.random.default_rng(3)
    t = np.sort(rng.uniform(0, 3 * 86_400, 20_000))  # three days of a flat load, plain CSV
    user = tmp_path / "user.csv"
    user.write_text("\n".join(f"{x:.3f}" for x in t))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal", "bench", "predictor", "--days", "3", "--rate", "2", "--window", "600",
         "--azure-dir", str(AZURE_EXCERPT), "--short-window", "15", "--warmup", "5",
         "--trace", str(user), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert SUMMARY.match(lines[-1]), lines[-1]
    for name in ("azureconv-like", "azurecode-like", "mixed", "azure-2023-conv", "azure-2023-code", "user.csv"):
        assert any(line.startswith(f"bench predictor ({name}): ensemble_avg_err=") for line in lines), name
        assert any(line.startswith(f"bench predictor ({name}) concurrency: ") for line in lines), name
    for name in ("azure-2023-conv", "user.csv"):  # the guarded ensemble is scored on every trace
        line = next(x for x in lines if x.startswith(f"bench predictor ({name}): "))
        assert re.search(r" guarded_avg_err=\d+\.\d% ", line), line
    report = (out / "report.md").read_text()
    assert "## azure-2023-conv" in report and "| ewma_slow |" in report and "| ensemble+guard |" in report
    assert "| azure-2023-code | conc |" in report  # the per-trace table, not only the pooled line
    results = json.loads((out / "results.json").read_text())
    conv = results["traces"]["azure-2023-conv"]
    assert conv["window_s"] == 15 and not conv["seasonal"] and conv["scored_windows"] == 19 - 5
    assert 0 <= conv["p90_coverage"]["rate"] <= 100
    assert results["traces"]["azureconv-like"]["seasonal"]


def test_missing_azure_directory_is_a_note_not_an_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tidal", "bench", "predictor", "--days", "2.1", "--rate", "1", "--window", "1800",
         "--azure-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "note: azure-2023-conv:" in proc.stdout and "not found, skipped" in proc.stdout
    assert SUMMARY.match(proc.stdout.strip().splitlines()[-1])

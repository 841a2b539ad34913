"""`tidal bench predictor` end to end on a short Azure-like week and a user's plain CSV trace."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tidal.bench.predictor_traces import read_arrivals

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = re.compile(r"^bench predictor: avg_err=\d+\.\d% peak_err=\d+\.\d% "
                     r"naive_avg_err=\d+\.\d% naive_peak_err=\d+\.\d% "
                     r"seasonal_naive_avg_err=\d+\.\d% seasonal_naive_peak_err=\d+\.\d%$")


def test_plain_csv_of_timestamps_and_models(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("time,model\n100.0,a\n101.5,b\n160,a\n")
    per, span = read_arrivals(csv)
    assert span == 60.0 and np.allclose(per["a"], [0.0, 60.0]) and np.allclose(per["b"], [1.5])
    bad = tmp_path / "bad.csv"
    bad.write_text("1.0\nnot-a-time\n")
    try:
        read_arrivals(bad)
    except SystemExit as exc:
        assert "bad.csv:2: bad timestamp" in str(exc)
    else:
        raise AssertionError("a bad timestamp was accepted")


def test_bench_scores_azure_like_and_a_user_trace(tmp_path):
    rng = np.random.default_rng(3)
    t = np.sort(rng.uniform(0, 3 * 86_400, 20_000))  # three days of a flat load, plain CSV
    user = tmp_path / "user.csv"
    user.write_text("\n".join(f"{x:.3f}" for x in t))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tidal", "bench", "predictor", "--days", "3", "--rate", "2", "--window", "600",
         "--trace", str(user), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert SUMMARY.match(lines[-1]), lines[-1]
    assert any(line.startswith("bench predictor (user.csv): avg_err=") for line in lines)
    report = (out / "report.md").read_text()
    assert "## azureconv-like" in report and "## user.csv" in report and (out / "results.json").exists()

"""`tidal bench kunserve-exchange` on a tiny model: victims really decode through remote attention
while KV moves (the exchange happened), the histogram covers every timed step, and the summary
line carries the keys docs/benchmarks.md quotes."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SUMMARY = re.compile(r"^bench kunserve-exchange: max_step_ratio=(\d+\.\d\d) p99_step_ms=(\d+\.\d) "
                     r"baseline_p99_step_ms=(\d+\.\d)$", re.M)


def test_tiny_run_exchanges_kv_and_times_both_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    steps = 6
    proc = subprocess.run(
        [sys.executable, "-m", "tidal.bench.kunserve_exchange", "--layers", "4", "--hidden", "64", "--heads", "4",
         "--requests", "2", "--prompt", "32", "--steps", str(steps), "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert SUMMARY.search(proc.stdout), proc.stdout
    data = json.loads((out / "steps.json").read_text())
    assert len(data["exchange_s"]) == len(data["baseline_s"]) == 2 * steps  # one step per member per round
    assert data["kv_bytes"] > 0 and data["remote_attention"] > 0  # KV moved, victims attended remotely
    rows = re.findall(r"^\s+[<>]=? ?\d\.\d\dx \|\s+(\d+) \|\s+(\d+)$", proc.stdout, re.M)
    assert sum(int(b) for b, _ in rows) == sum(int(e) for _, e in rows) == 2 * steps
